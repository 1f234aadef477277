"""Decode tokens/s, 512-token prefill and resident weight memory: packed checkpoint vs the dense
model holding the same decoded weights, both in one compute dtype (``--dtype``, default the CPU's:
bfloat16 only with native bf16 dot products; ``--as-avx2``: as on an AVX2-only CPU, float32).

Models: both trained reference models (hybrid MoE and Llama), a random transformers Qwen3-MoE
of similar size and, when prepared (``make real-model``), the real SmolLM2-135M-Instruct.
Widths: uniform 4-bit (Linears on the int4 kernel), uniform 3-bit (the packed matvec kernels)
and a mixed allocation (attention 8, expert banks 3, others 4). Then the seed
architecture at full size (1.69 B, random weights) with the seed checkpoint's own widths.
Beside each small model's decode: the ceiling, a packed copy whose Linears, tied head and
expert-bank products cost nothing (what the rest of a step leaves to kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from benchmarks.common import figure, machine, rerun_as_avx2
from dynquant.models.sources import resolve_model
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.report.demo import demo_widths
from dynquant.runtime.loader import load, load_dequantized
from dynquant.runtime.memory import resident_weight_nbytes
from dynquant.runtime.packed_modules import QuantExpertBank, QuantLinear, TiedQuantHead
from scripts.prepare_real_model import real_model

NEW_TOKENS = 32
ROUNDS = 3
PREFILL_TOKENS = 512
SEED_WIDTHS = Path(__file__).parents[1] / "tests" / "data" / "seed_dynquant.json"


def qwen3_moe_dir(root: Path) -> Path:
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                         moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, num_experts=16,
                         num_experts_per_tok=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(root / "qwen3moe")
    return root / "qwen3moe"


def decode_seconds(model: torch.nn.Module, vocab: int, new_tokens: int) -> float:
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def tokens_per_second(models: tuple[torch.nn.Module, ...], vocab: int,
                      new_tokens: int = NEW_TOKENS, rounds: int = ROUNDS
                      ) -> tuple[list[float], list[float]]:
    """(tokens/s of a whole ``generate`` with its 16-token prompt, tokens/s of the decode steps
    alone) for each model: best of ``rounds``, the models taking turns (this machine's speed
    drifts by tens of percent over minutes: turns keep a drift from favouring one of them). The
    steps alone are the difference between ``new_tokens`` and one new token, which leaves out
    the prompt's forward and generate's set-up."""
    best = [float("inf")] * len(models)
    first = [float("inf")] * len(models)
    with torch.no_grad():
        for model in models:
            decode_seconds(model, vocab, 4)  # warm-up
        for _ in range(rounds):
            for i, model in enumerate(models):
                best[i] = min(best[i], decode_seconds(model, vocab, new_tokens))
                first[i] = min(first[i], decode_seconds(model, vocab, 1))
    return ([new_tokens / b for b in best],
            [(new_tokens - 1) / (b - f) for b, f in zip(best, first, strict=True)])


def prefill_seconds(models: tuple[torch.nn.Module, ...], vocab: int, tokens: int,
                    rounds: int = ROUNDS) -> list[float]:
    """Best of ``rounds`` one-forward prefills of ``tokens`` tokens, the models taking turns."""
    prompt = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    best = [float("inf")] * len(models)
    with torch.no_grad():
        for model in models:
            model(prompt[:, :16])
        for _ in range(rounds):
            for i, model in enumerate(models):
                start = time.perf_counter()
                model(prompt, logits_to_keep=1)
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _zeros(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros((*x.shape[:-1], self.out_features))


def _head_zeros(self: TiedQuantHead, h: torch.Tensor) -> torch.Tensor:
    return h.new_zeros((*h.shape[:-1], self.embedding[0].num_embeddings))


def _pairs_zeros(axis: int):
    def pairs(self: QuantExpertBank, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((x.shape[0], self.layout.logical_shape[axis]))
    return pairs


def free_products(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every packed Linear, tied head and expert bank's decode pairs answering
    zeros at no cost: the decode speed no kernel can pass, the rest of a step (norms, attention,
    routing, the framework) being what it is."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.forward = types.MethodType(_zeros, module)
        elif isinstance(module, TiedQuantHead):
            module.forward = types.MethodType(_head_zeros, module)
        elif isinstance(module, QuantExpertBank):
            module.pairs_linear = types.MethodType(_pairs_zeros(1), module)
            module.pairs_matmul = types.MethodType(_pairs_zeros(2), module)
    return model


def compare(name: str, ck: Path, vocab: int, dtype: torch.dtype,
            new_tokens: int = NEW_TOKENS, ceiling: bool = True) -> None:
    """Packed vs dense; with ``ceiling``, a third copy with free products takes its turns too."""
    packed, dense = load(ck, dtype=dtype), load_dequantized(ck, dtype)
    models = (packed, dense, free_products(load(ck, dtype=dtype))) if ceiling else (packed, dense)
    (tp, td, *_), (sp, sd, *free) = tokens_per_second(models, vocab, new_tokens)
    pp, pd = prefill_seconds((packed, dense), vocab, PREFILL_TOKENS)
    mp, md = resident_weight_nbytes(packed), resident_weight_nbytes(dense)
    figure(f"{name}: packed decode", tp, "tok/s")
    figure(f"{name}: dense decode", td, "tok/s")
    figure(f"{name}: decode speed packed / dense", tp / td, "x")
    figure(f"{name}: decode steps alone packed / dense", sp / sd, "x")
    if free:
        figure(f"{name}: decode steps alone, free products / dense (the ceiling)", free[0] / sd,
               "x")
    figure(f"{name}: prefill {PREFILL_TOKENS} speed packed / dense", pd / pp, "x")
    figure(f"{name}: prefill {PREFILL_TOKENS} packed", PREFILL_TOKENS / pp, "tok/s")
    figure(f"{name}: resident weights packed / dense", mp / md, "x")


def main() -> None:
    from dynquant.numerics.compute_dtype import dtype_name, resolve_dtype

    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--skip-seed", action="store_true", help="leave out the 1.69 B model")
    parser.add_argument("--only-seed", action="store_true", help="the 1.69 B model alone")
    parser.add_argument("--as-avx2", action="store_true",
                        help="as on an AVX2-only CPU (kernels for x86-64-v3, torch capped at "
                             "AVX2, float32)")
    args = parser.parse_args()
    if args.as_avx2:
        rerun_as_avx2("benchmarks.decode", [a for a in sys.argv[1:] if a != "--as-avx2"])
    dtype = resolve_dtype(args.dtype)
    print(f"# decode, batch 1, {NEW_TOKENS} new tokens, {dtype_name(dtype)}, {machine()}")
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = Path(__file__).parents[1] / "models"
        sources = {"hybrid-ref": (resolve_model(str(models / "hybrid-ref")), False, 4096),
                   "llama-ref": (resolve_model(str(models / "llama-ref")), False, 4096),
                   "qwen3-moe": (resolve_model(str(qwen3_moe_dir(root))), False, 4096)}
        real = real_model()
        if real is not None:
            sources["smollm2-135m"] = (resolve_model(str(real)), False, 49152)
        for name, (source, random_init, vocab) in ({} if args.only_seed else sources).items():
            modules = [s.module for s in source.tensor_specs() if s.quantizable]
            for label, widths in (("uniform-4", {m: 4 for m in modules}),
                                  ("uniform-3", {m: 3 for m in modules}),
                                  ("mixed", demo_widths(modules))):
                ck = root / f"{name}-{label}"
                quantize_model(source, widths, ck, random_init=random_init, progress=False)
                compare(f"{name} {label}", ck, vocab, dtype)
        if args.skip_seed:
            return
        # the seed architecture at full size (1.69 B, random weights) with the seed's widths
        seed = resolve_model("seed")
        widths = {m: e["bits"] for m, e in json.loads(SEED_WIDTHS.read_text())["layers"].items()}
        quantize_model(seed, widths, root / "seed", random_init=True, progress=False)
        compare("seed 1.69B (seed widths, 3.25 bits)", root / "seed",
                seed.config.vocab_size, dtype, new_tokens=16, ceiling=False)


if __name__ == "__main__":
    main()
