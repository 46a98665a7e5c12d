"""Build tiny Llama models and their tokenizer offline, for real `vllm serve` on CPU.

Run with the vLLM venv's python (the router's venv has no torch):

    $HOTSWAP_VLLM_VENV/bin/python tests/integration/tiny_models.py OUT_DIR

writes OUT_DIR/target and OUT_DIR/second (same tokenizer, different random weights) and
prints OUT_DIR. Nothing is downloaded: the tokenizer is a byte-level BPE trained here on
generated sentences, the models are randomly initialised from fixed seeds. The test
fixtures cache OUT_DIR under a key made of this file's content hash, so changing anything
below rebuilds.

Shapes: hidden 128, 4 heads of head_dim 32 (vLLM's CPU attention needs head_dim >= 32),
2 layers, vocab ~512, float32.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

VOCAB_SIZE = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MODELS = {"target": 1234, "second": 5678}  # name -> weight seed

SUBJECTS = "the cat,a dog,my friend,the router,an engine,the model,a student,the river,our team,the old man,a bird,the server".split(",")
VERBS = "sees,likes,builds,wakes,reads,moves,finds,swaps,carries,follows,answers,loads".split(",")
OBJECTS = "the ball,a small house,the red door,some weights,a long road,the green tree,a fast token,the quiet city,a cold drink,the first page".split(",")
TAILS = "today,at night,very slowly,with care,in the morning,again,before lunch,after the rain,on the hill,for a while".split(",")


def sentences(n: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}."
        if i % 3 == 0:
            s = s.capitalize() + f" It was {rng.randint(0, 999)} steps, {rng.choice('abcdefghijklmnopqrstuvwxyz')}!"
        out.append(s)
    return out


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, tokenizer, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Large init: random weights with the usual 0.02 give near-uniform logits; this
        # makes greedy decoding varied and confidently decided (no near-ties between
        # target and draft kernels).
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def build(root: Path) -> Path:
    """Build every model under `root`, atomically: a half-built tree never sits at `root`,
    and two builders racing for the same `root` both end with the same complete tree."""
    if (root / "DONE").exists():
        return root
    staging = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tokenizer = build_tokenizer(staging / "tokenizer")
    for name, seed in MODELS.items():
        build_model(staging / name, tokenizer, seed)
    (staging / "DONE").write_text(json.dumps({"models": MODELS, "vocab": len(tokenizer)}) + "\n")
    if (root / "DONE").exists():  # someone else finished first: theirs is identical
        shutil.rmtree(staging)
        return root
    shutil.rmtree(root, ignore_errors=True)  # a leftover without DONE
    try:
        staging.rename(root)
    except OSError:  # lost a race to another builder's rename
        shutil.rmtree(staging, ignore_errors=True)
        if not (root / "DONE").exists():
            raise
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    print(build(Path(sys.argv[1]).resolve()))
