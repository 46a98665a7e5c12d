"""Build a tiny LoRA adapter for the tiny target model offline, for real `vllm serve --enable-lora`.

Run with the vLLM venv's python (torch and safetensors live there):

    $HOTSWAP_VLLM_VENV/bin/python tests/integration/tiny_lora.py TARGET_DIR OUT_DIR

writes OUT_DIR/adapter_config.json and OUT_DIR/adapter_model.safetensors in PEFT's layout
(what vLLM loads): rank 8 on q_proj and v_proj of every layer, from a fixed seed. PEFT
initialises lora_B to zero (an adapter that changes nothing); here it is random and large
enough that the adapter's greedy output differs from the base model's, so a test can tell
which one answered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8
SEED = 4242
MODULES = ("q_proj", "v_proj")


def build(target: Path, out: Path) -> None:
    config = json.loads((target / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    sizes = {"q_proj": heads * head_dim, "v_proj": config.get("num_key_value_heads", heads) * head_dim}
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(sizes[module], RANK, generator=gen) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": str(target), "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK,
        "lora_alpha": 2 * RANK, "lora_dropout": 0.0, "target_modules": list(MODULES), "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True,
    }, indent=1))


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
    print(sys.argv[2])
