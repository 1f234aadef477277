"""How close prefill products run to this CPU's arithmetic peak: the bound on packed prefill.

A 512-token product is compute bound: reading packed weights saves memory traffic but not one
multiply-accumulate. So a packed prefill can beat the dense one only where the dense GEMM runs
well below the machine's peak. This measures, in one run:

- the peak multiply-accumulate rate of one instruction (``probes/mac_peak.c``, 12 independent
  accumulators in registers): ``vdpbf16ps`` (bf16 pairs into float32, where the CPU has
  AVX512_BF16) and float32 ``vfmadd231ps`` on zmm (AVX-512) and ymm (AVX2), on 1 and all threads;
- torch's dense GEMM in bf16 and float32 at 512 tokens on the shapes of the real SmolLM2 model
  and at 4096 x 4096, as a fraction of that peak;
- the packed products at the same shapes: the float32 packed GEMM (``native/packed_gemm.c``) and
  the bf16 path of ``QuantLinear`` (row blocks dequantized into a reused buffer, then torch's bf16
  GEMM), as a ratio to dense and a fraction of peak.

``--as-avx2``: as on an AVX2-only CPU (kernels for x86-64-v3, torch capped at AVX2): float32
against the ymm peak, no bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import best_time, figure, machine, rerun_as_avx2
from dynquant import quantize_tensor
from dynquant.numerics.compute_dtype import bf16_native, cpu_flags
from dynquant.numerics.packed_matvec import packed_gemm, simd_path
from dynquant.runtime.packed_modules import QuantLinear

TOKENS = 512
REPEAT = 20  # best of: this machine's speed drifts, and the first runs of a shape are slow
SHAPES = ((1536, 576), (576, 1536), (4096, 4096))  # (out, in): SmolLM2's MLP, and a 7B-class one
PROBE = Path(__file__).parent / "probes" / "mac_peak.c"


def peak_rates(threads: int) -> dict[str, float]:
    """GMAC/s of each instruction this CPU has, best of three runs, on ``threads`` threads."""
    flags = cpu_flags()
    wanted = [("vfmadd231ps-ymm", "fma" in flags), ("vfmadd231ps-zmm", "avx512f" in flags),
              ("vdpbf16ps", "avx512_bf16" in flags)]
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "mac_peak"
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-pthread", str(PROBE), "-o", str(exe)],
                       check=True)
        for name, present in wanted:
            if present:
                runs = [float(subprocess.run([str(exe), name, str(threads)], check=True,
                                             capture_output=True, text=True).stdout)
                        for _ in range(3)]
                rates[name] = max(runs)
    return rates


def quant_linear(q, dtype: torch.dtype) -> QuantLinear:
    """A QuantLinear holding the quantized tensor ``q``."""
    module = QuantLinear(q.layout, None, dtype)
    module.load_state_dict({"qweight": q.qweight, "scales": q.scales, "offsets": q.offsets},
                           assign=True)
    return module


def main() -> None:
    if "--as-avx2" in sys.argv:
        rerun_as_avx2("benchmarks.gemm_peak", [])
    avx2_build = simd_path() == "avx2"  # its tiles are ymm: held to the ymm peak, no bf16
    threads = torch.get_num_threads()
    print(f"# prefill products vs the CPU's peak, {TOKENS} tokens, 3-bit, {machine()}")
    torch.set_grad_enabled(False)
    peaks = peak_rates(threads)
    for name, rate in peak_rates(1).items():
        figure(f"peak {name}, 1 thread", rate, "GMAC/s")
    for name, rate in peaks.items():
        figure(f"peak {name}, {threads} threads", rate, "GMAC/s")
    fp32_peak = peaks.get("vfmadd231ps-ymm" if avx2_build else "vfmadd231ps-zmm",
                          peaks.get("vfmadd231ps-ymm"))
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f, generator=g)
        macs = out_f * in_f * TOKENS / 1e9
        x = torch.randn(TOKENS, in_f, generator=g)
        q = quantize_tensor(w, 3)
        dense = q.dequantize(torch.float32)
        label = f"{out_f} x {in_f}"
        t_dense = best_time(lambda x=x, d=dense: F.linear(x, d), repeat=REPEAT)
        t_packed = best_time(lambda x=x, q=q: packed_gemm(x, q.qweight, q.scales, q.offsets,
                                                          q.layout), repeat=REPEAT)
        figure(f"{label} float32 dense", macs / t_dense, "GMAC/s")
        figure(f"{label} float32 packed GEMM", macs / t_packed, "GMAC/s")
        if fp32_peak:
            figure(f"{label} float32 dense / fp32 FMA peak", macs / t_dense / fp32_peak, "x")
            figure(f"{label} float32 packed / fp32 FMA peak", macs / t_packed / fp32_peak, "x")
        figure(f"{label} float32 packed / dense speed", t_dense / t_packed, "x")
        if avx2_build or not bf16_native(cpu_flags()):
            continue
        xb, db = x.bfloat16(), dense.bfloat16()
        module = quant_linear(q, torch.bfloat16)
        t_dense_bf16 = best_time(lambda xb=xb, db=db: F.linear(xb, db), repeat=REPEAT)
        t_packed_bf16 = best_time(lambda xb=xb, m=module: m(xb), repeat=REPEAT)
        t_dequant = best_time(lambda m=module, o=out_f: m.dequantize_rows(0, o, scratch=True),
                              repeat=REPEAT)
        figure(f"{label} bf16 dense", macs / t_dense_bf16, "GMAC/s")
        if "vdpbf16ps" in peaks:
            figure(f"{label} bf16 dense / vdpbf16ps peak", macs / t_dense_bf16 / peaks["vdpbf16ps"],
                   "x")
        figure(f"{label} bf16 dequantization / dense GEMM time", t_dequant / t_dense_bf16, "x")
        figure(f"{label} bf16 packed (dequantized blocks) / dense speed",
               t_dense_bf16 / t_packed_bf16, "x")


if __name__ == "__main__":
    main()
