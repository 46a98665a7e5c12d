"""One engine process: its argv, its log, start and stop, and the reaper that runs it."""
