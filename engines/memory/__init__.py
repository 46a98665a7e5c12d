"""What the machine has and what an engine holds: GPUs and host RAM, an engine's host RAM for sleep, its checkpoint's size."""
