"""Peak memory of `dynquant quantize` on a multi-shard transformers model vs the model's size.

A 185 M-parameter Llama saved in bf16 shards of 100 MB is quantized (measure with the data-free
method -> allocate at 3.25 bits -> quantize) in a child process; its peak RSS is compared with the
dense model's bytes. Weights stream tensor by tensor from the memory-mapped shards.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.common import figure, machine, run_child


def main() -> None:
    print(f"# quantize peak RSS on a multi-shard model, {machine()}")
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "q"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        model.save_pretrained(src, max_shard_size="100MB")
        dense = sum(p.numel() * 2 for p in model.parameters())
        del model
        shards = len(list(src.glob("*.safetensors")))
        wall, rss = run_child(["-m", "dynquant", "quantize", str(src), "--budget", "3.25",
                               "-o", str(out), "--quiet"])
        doc = json.loads((out / "dynquant.json").read_text())
    figure("source shards", shards)
    figure("dense bf16 model", dense / 2**20, "MiB")
    figure("checkpoint total_nbytes", doc["accounting"]["total_nbytes"] / 2**20, "MiB")
    figure("quantize wall time (measure + allocate + quantize)", wall, "s")
    figure("quantize peak RSS", rss / 2**20, "MiB")
    figure("peak RSS / dense bf16 model", rss / dense, "x")


if __name__ == "__main__":
    main()
