"""Decode tokens/s and resident weight memory: packed checkpoint vs the dense bf16 model.

Models: both trained reference models (hybrid MoE and Llama) and a random transformers Qwen3-MoE
of similar size. Widths: uniform 4-bit (Linears on the int4 kernel), uniform 3-bit (Linears on
the packed matvec kernel) and a mixed allocation (attention 8, expert banks 3, others 4).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from benchmarks.common import figure, machine
from dynquant.models.sources import resolve_model
from dynquant.pipeline.demo import demo_widths
from dynquant.pipeline.quantize import quantize_model
from dynquant.runtime.loader import load, load_dequantized
from dynquant.runtime.memory import resident_weight_nbytes

NEW_TOKENS = 32


def qwen3_moe_dir(root: Path) -> Path:
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                         moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, num_experts=16,
                         num_experts_per_tok=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(root / "qwen3moe")
    return root / "qwen3moe"


def tokens_per_second(model: torch.nn.Module, vocab: int) -> float:
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                       do_sample=False)
    return NEW_TOKENS / (time.perf_counter() - start)


def compare(name: str, ck: Path, vocab: int) -> None:
    packed, dense = load(ck), load_dequantized(ck)
    tp, td = tokens_per_second(packed, vocab), tokens_per_second(dense, vocab)
    mp, md = resident_weight_nbytes(packed), resident_weight_nbytes(dense)
    figure(f"{name}: packed decode", tp, "tok/s")
    figure(f"{name}: dense bf16 decode", td, "tok/s")
    figure(f"{name}: decode speed packed / dense", tp / td, "x")
    figure(f"{name}: resident weights packed / dense", mp / md, "x")


def main() -> None:
    print(f"# decode, batch 1, {NEW_TOKENS} new tokens, {machine()}")
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = Path(__file__).parents[1] / "models"
        sources = {"hybrid-ref": (resolve_model(str(models / "hybrid-ref")), False, 4096),
                   "llama-ref": (resolve_model(str(models / "llama-ref")), False, 4096),
                   "qwen3-moe": (resolve_model(str(qwen3_moe_dir(root))), False, 4096)}
        for name, (source, random_init, vocab) in sources.items():
            modules = [s.module for s in source.tensor_specs() if s.quantizable]
            for label, widths in (("uniform-4", {m: 4 for m in modules}),
                                  ("uniform-3", {m: 3 for m in modules}),
                                  ("mixed", demo_widths(modules))):
                ck = root / f"{name}-{label}"
                quantize_model(source, widths, ck, random_init=random_init, progress=False)
                compare(f"{name} {label}", ck, vocab)


if __name__ == "__main__":
    main()
