"""Peak memory of `dynquant quantize` on a multi-shard transformers model vs the model's size.

An 885 M-parameter Llama saved in bf16 shards of 500 MB is quantized (measure with the data-free
method -> allocate at 3.25 bits -> quantize) in a child process; its peak RSS is compared with the
dense model's bytes. Weights stream tensor by tensor from the shards (positioned reads).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.common import figure, machine, run_child
from scripts.bpe_tokenizer import train_bpe_tokenizer

CALIB = Path(__file__).parents[1] / "data" / "calibration.txt"

EMBEDDING = """
import resource, torch
from dynquant import quantize_tensor
w = torch.randn(151936, 1024)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
qt = quantize_tensor(w, 4)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def embedding_scratch() -> None:
    """Extra peak memory of quantizing a 151936 x 1024 embedding, beyond its float32 input."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EMBEDDING], check=True, capture_output=True,
                         text=True).stdout
    extra = int(out.strip().splitlines()[-1])
    figure("151936x1024 4-bit: peak memory beyond the input (output included)", extra / 2**20,
           "MiB")


LLAMA_885M = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8)


def save_sharded(cfg: LlamaConfig, src: Path) -> int:
    """A random model of ``cfg`` saved in bf16 shards of 500 MB; its dense bytes."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(src, max_shard_size="500MB")
    return sum(p.numel() * 2 for p in model.parameters())


def main() -> None:
    print(f"# quantize peak RSS on a multi-shard model, {machine()}")
    embedding_scratch()
    cfg = LLAMA_885M
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "q"
        dense = save_sharded(cfg, src)
        shards = len(list(src.glob("*.safetensors")))
        _, baseline = run_child(["-c", "import dynquant.cli, transformers"])
        wall, rss = run_child(["-m", "dynquant", "quantize", str(src), "--budget", "3.25",
                               "-o", str(out), "--quiet"])
        doc = json.loads((out / "dynquant.json").read_text())
    figure("source shards", shards)
    figure("dense bf16 model", dense / 2**20, "MiB")
    figure("checkpoint total_nbytes", doc["accounting"]["total_nbytes"] / 2**20, "MiB")
    figure("quantize wall time (measure + allocate + quantize)", wall, "s")
    figure("quantize peak RSS", rss / 2**20, "MiB")
    figure("peak RSS / dense bf16 model", rss / dense, "x")
    figure("RSS of the imports alone (python, torch, transformers)", baseline / 2**20, "MiB")
    figure("(peak RSS - imports) / dense bf16 model", (rss - baseline) / dense, "x")
    calibrated_measure(cfg)


def save_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer trained on the calibration text (the model is random: only
    token ids matter)."""
    train_bpe_tokenizer([CALIB.read_text(encoding="utf-8")], 4096, out)


def calibrated_measure(cfg: LlamaConfig) -> None:
    """`dynquant measure --calib` (streamed Fisher) on the same model: one block in memory.
    The exact probe (--method kl-exact) holds the whole model in float32: 2x its bf16 size."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        dense = save_sharded(cfg, src)
        save_tokenizer(src)
        wall, rss = run_child(["-m", "dynquant", "measure", str(src), "--calib", str(CALIB),
                               "-o", str(Path(tmp) / "m" / "maps.json")])
    figure("measure --calib (fisher, 8x256 tokens) wall time", wall, "s")
    figure("measure --calib (fisher) peak RSS", rss / 2**20, "MiB")
    figure("measure --calib (fisher) peak RSS / dense bf16 model", rss / dense, "x")


if __name__ == "__main__":
    main()
