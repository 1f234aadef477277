"""Install llama-cpp-python (llama.cpp's Python binding) for ``benchmarks/vs_llamacpp.py``.

pip builds it from source, so its kernels are this machine's: the x86 instruction sets are
named from the CPU's own flags (GGML_NATIVE would pass ``-march=native``, which on CPUs with AMX
also emits AMX instructions, and some machines trap them). ``--avx2``: AVX2/FMA/F16C only, the
build an AVX2-only CPU gets, into ``--target`` (point ``$LLAMA_CPP_LIB_PATH`` at its
``llama_cpp/lib`` for ``vs_llamacpp --as-avx2``).

    python scripts/install_llama_cpp.py              # into the running environment
    python scripts/install_llama_cpp.py --avx2 --target ~/.cache/dynquant/llama-cpp-avx2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"
BASE = ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")
# CPU flag -> ggml option, beyond the AVX2 base
EXTRA = {"avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
         "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
         "avx_vnni": "GGML_AVX_VNNI"}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(avx2_only: bool) -> str:
    flags = cpu_flags()
    on = [*BASE, *([] if avx2_only else [opt for f, opt in EXTRA.items() if f in flags])]
    off = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16",
           *(opt for opt in EXTRA.values() if opt not in on)]
    return " ".join(["-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     *(f"-D{o}=ON" for o in on), *(f"-D{o}=OFF" for o in off)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--avx2", action="store_true", help="AVX2/FMA/F16C only")
    parser.add_argument("--target", help="install into this folder instead")
    args = parser.parse_args()
    env = {**os.environ, "CMAKE_ARGS": cmake_args(args.avx2),
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    cmd = [sys.executable, "-m", "pip", "install", "-q", PACKAGE]
    if args.target:
        cmd += ["--no-deps", "--target", args.target]
    print(f"CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
    subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
