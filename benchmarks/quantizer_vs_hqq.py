"""dynquant's quantizer vs HQQ (``hqq`` on CPU, optimize=True, group size 128, groups along the
input dimension): time and relative weight error at 2, 3 and 4 bits, on an i.i.d. N(0,1)
4096 x 4096 weight and on the real weights of both reference models. Needs ``pip install hqq``.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import figure, machine
from dynquant import quantize_tensor
from dynquant.models.sources import resolve_model
from dynquant.numerics import native
from dynquant.pipeline.calibrate.weights import SafetensorsWeights

ROOT = Path(__file__).parents[1]


def hqq_quantize(w: torch.Tensor, bits: int) -> tuple:
    from hqq.core.quantize import Quantizer

    return Quantizer.quantize(w, nbits=bits, channel_wise=True, group_size=128, optimize=True,
                              round_zero=False, axis=1, bitpack=False,
                              compute_dtype=torch.float32, device="cpu")


def hqq_dequantize(quantized: tuple, shape: torch.Size) -> torch.Tensor:
    from hqq.core.quantize import Quantizer

    return Quantizer.dequantize(*quantized).float().reshape(shape)


def rel_err(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((w - w_hat).double().square().sum() / w.double().square().sum())


@contextmanager
def torch_path():
    os.environ["DYNQUANT_NATIVE"] = "0"
    try:
        yield
    finally:
        del os.environ["DYNQUANT_NATIVE"]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def reference_weights() -> list[torch.Tensor]:
    """Every 2-D quantizable matrix of both reference models whose rows are multiples of 128."""
    mats = []
    for name in ("hybrid-ref", "llama-ref"):
        source = resolve_model(str(ROOT / "models" / name))
        weights = SafetensorsWeights(source.directory, source.conversion_transforms())
        for spec in source.tensor_specs():
            if spec.quantizable and len(spec.shape) == 2 and spec.shape[-1] % 128 == 0:
                mats.append(weights.get(spec).float())
        weights.close()
    return mats


def compare(label: str, mats: list[torch.Tensor]) -> None:
    """Each tool quantizes the whole set in a pass of its own (no interleaving: one tool's thread
    pool must not run while the other is timed)."""
    total = sum(float(m.double().square().sum()) for m in mats)
    share = [float(w.double().square().sum()) / total for w in mats]
    for bits in (2, 3, 4):
        ours, t_d = timed(lambda b=bits: [quantize_tensor(w, b) for w in mats])
        theirs, t_h = timed(lambda b=bits: [hqq_quantize(w, b) for w in mats])  # not packed
        with torch_path():  # the fallback without a C compiler: same codes, slower
            _, t_t = timed(lambda b=bits: [quantize_tensor(w, b) for w in mats])
        e_d = sum(s * rel_err(w, qt.dequantize(torch.float32))
                  for s, w, qt in zip(share, mats, ours, strict=True))
        e_h = sum(s * rel_err(w, hqq_dequantize(hq, w.shape))
                  for s, w, hq in zip(share, mats, theirs, strict=True))
        figure(f"{label} {bits}-bit: dynquant relative error", e_d)
        figure(f"{label} {bits}-bit: HQQ relative error", e_h)
        figure(f"{label} {bits}-bit: error ratio dynquant / HQQ", e_d / e_h, "x")
        figure(f"{label} {bits}-bit: dynquant time", t_d, "s")
        figure(f"{label} {bits}-bit: HQQ time", t_h, "s")
        figure(f"{label} {bits}-bit: speed-up vs HQQ", t_h / t_d, "x")
        figure(f"{label} {bits}-bit: dynquant torch-path (fallback) time", t_t, "s")
        figure(f"{label} {bits}-bit: torch-path speed-up vs HQQ", t_h / t_t, "x")


def main() -> None:
    start = time.perf_counter()
    kernel = "native kernel" if native.available() else "torch path (no C compiler)"
    loaded = time.perf_counter() - start
    print(f"# quantizer vs HQQ, group size 128, dynquant {kernel}, {machine()}")
    figure("native kernel build or load (once per machine, not in the times below)", loaded, "s")
    quantize_tensor(torch.randn(256, 256), 4)  # warm both tools up
    hqq_quantize(torch.randn(256, 256), 4)
    compare("N(0,1) 4096x4096", [torch.randn(4096, 4096,
                                             generator=torch.Generator().manual_seed(0))])
    compare("reference models", reference_weights())


if __name__ == "__main__":
    main()
