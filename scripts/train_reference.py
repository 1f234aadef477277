"""Train the shipped reference models on real English text (seeded, CPU, time-boxed).

    python -m scripts.train_reference corpus  --data-dir ../shared/data   # tokenizer + texts
    python -m scripts.train_reference train --arch hybrid --minutes 30 --threads 1 &
    python -m scripts.train_reference train --arch llama --minutes 30 --threads 1

The corpus step writes the byte-level BPE tokenizer (``tokenizers``), the held-out evaluation
text ``data/heldout.txt`` (never trained on) and ``data/calibration.txt`` (a slice of the
training distribution). Models go to ``models/<name>/`` with a model card.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from dynquant.models.hybrid import DynquantHybridConfig
from dynquant.models.registration import register
from scripts.bpe_tokenizer import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 4096
SEQ = 256
BATCH = 16
# (file, share kept for training); the tail of TinyStories and all of WikiText-2 test are held out
SOURCES = {"tinystories_valid.txt": 0.92, "shakespeare.txt": 1.0, "kjv_bible.txt": 1.0,
           "wikitext2_valid.txt": 1.0}
HELDOUT_WIKITEXT_CHARS = 40_000
CALIBRATION_CHARS = 40_000

ARCHS = {
    "hybrid": lambda: DynquantHybridConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, attention_layers=[1, 3],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, shared_intermediate_size=128,
        max_position_embeddings=1024, tie_word_embeddings=True),
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=0),
}
NAMES = {"hybrid": "hybrid-ref", "llama": "llama-ref"}


def build_corpus(data_dir: Path) -> None:
    train_parts, heldout = [], []
    for name, share in SOURCES.items():
        text = (data_dir / name).read_text(encoding="utf-8")
        cut = int(len(text) * share)
        cut = text.find("\n\n", cut) if share < 1 else cut  # at a story boundary
        train_parts.append(text[:cut])
        if share < 1:
            heldout.append(text[cut:].strip())
    wiki = (data_dir / "wikitext2_test.txt").read_text(encoding="utf-8")
    heldout.append(wiki[:wiki.find("\n", HELDOUT_WIKITEXT_CHARS)].strip())
    (ROOT / "data").mkdir(exist_ok=True)
    (ROOT / "data" / "heldout.txt").write_text("\n\n".join(heldout) + "\n", encoding="utf-8")
    train = "\n\n".join(train_parts)
    rng = random.Random(0)
    start = rng.randrange(0, len(train) - CALIBRATION_CHARS)
    (ROOT / "data" / "calibration.txt").write_text(train[start:start + CALIBRATION_CHARS],
                                                   encoding="utf-8")
    fast = train_bpe_tokenizer(train_parts, VOCAB, ROOT / "build" / "tokenizer", pad=True)
    ids = fast(train)["input_ids"]
    torch.save(torch.tensor(ids, dtype=torch.int16), ROOT / "build" / "train_ids.pt")
    print(f"train tokens: {len(ids):,}; held-out chars: {sum(map(len, heldout)):,}")


def batches(ids: torch.Tensor, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=gen)
        yield torch.stack([ids[s:s + SEQ + 1] for s in starts.tolist()]).long()


def evaluate(model, tokenizer, text: str) -> float:
    ids = torch.tensor(tokenizer(text)["input_ids"])
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - SEQ, SEQ):
            x = ids[s:s + SEQ + 1][None]
            logits = model(x[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            count += SEQ
    model.train()
    return math.exp(nll / count)


def train(arch: str, minutes: float, seed: int, lr: float, threads: int,
          steps: int | None = None) -> None:
    """Train for ``steps`` (exactly reproducible) or, without it, for ``minutes`` (time-boxed:
    the cosine schedule's length is then estimated from the first 20 steps and recorded)."""
    register()
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ROOT / "build" / "tokenizer")
    ids = torch.load(ROOT / "build" / "train_ids.pt", weights_only=True).long()
    config = ARCHS[arch]()
    model = AutoModelForCausalLM.from_config(config).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    deadline = float("inf") if steps else time.monotonic() + minutes * 60
    est_steps = steps
    step, t0 = 0, time.monotonic()
    for batch in batches(ids, gen):
        if time.monotonic() > deadline or (steps is not None and step >= steps):
            break
        if step == 20 and steps is None:  # the schedule's length from the measured step time
            est_steps = int(20 * minutes * 60 / (time.monotonic() - t0))
        total = est_steps or 10**9
        scale = min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(step / total, 1)))
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.05)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        aux = sum(getattr(m, "aux_loss", 0.0) for m in model.modules() if hasattr(m, "aux_loss"))
        opt.zero_grad(set_to_none=True)
        (loss + 0.01 * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.monotonic() - t0:.0f} s)",
                  flush=True)
        step += 1
    heldout = (ROOT / "data" / "heldout.txt").read_text(encoding="utf-8")
    ppl = evaluate(model, tokenizer, heldout)
    out = ROOT / "models" / NAMES[arch]
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    card = {"arch": arch, "parameters": params, "steps": step, "batch": BATCH, "seq": SEQ,
            "tokens_seen": step * BATCH * SEQ, "minutes": minutes, "threads": threads,
            "schedule_steps": est_steps,
            "seed": seed, "lr": lr,
            "heldout_ppl_fp32": round(ppl, 3)}
    (out / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    write_card(arch)
    print(json.dumps(card))


CARD = """# {name}: dynquant reference model ({arch})

A small {desc} trained from scratch by `scripts/train_reference.py` (seed {seed}) for
dynquant's demo, tests and benchmarks. Not a useful language model: a realistic one to quantize.

| | |
|---|---|
| architecture | {arch_line} |
| parameters | {parameters:,} (bf16 safetensors, {mib:.1f} MiB) |
| tokenizer | byte-level BPE, {vocab} tokens (`tokenizers`), trained on the training text |
| training data | TinyStories excerpt (first 92%), Shakespeare, KJV Bible, WikiText-2 \
validation: sources and licences in `data/README.md` |
| training | {steps} steps of {batch} x {seq} tokens ({tokens:,} tokens), AdamW lr {lr}, \
cosine, {minutes} min on {threads} CPU thread(s) |
| held-out perplexity | {ppl} on `data/heldout.txt` (fp32; never trained on) |
"""


def write_card(arch: str) -> None:
    out = ROOT / "models" / NAMES[arch]
    info = json.loads((out / "training.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    if arch == "hybrid":
        desc = "hybrid short-convolution / attention Mixture-of-Experts model"
        arch_line = (f"dynquant_hybrid: {cfg['num_hidden_layers']} layers (attention at "
                     f"{cfg['attention_layers']}, short conv elsewhere), hidden "
                     f"{cfg['hidden_size']}, {cfg['num_experts']} routed experts of width "
                     f"{cfg['moe_intermediate_size']} (top-{cfg['num_experts_per_tok']}) + a "
                     f"shared expert of width {cfg['shared_intermediate_size']}, tied embeddings")
    else:
        desc = "Llama-architecture model whose matrix dimensions are multiples of 256"
        arch_line = (f"llama: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                     f"MLP {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads / "
                     f"{cfg['num_key_value_heads']} KV heads, tied embeddings")
    mib = (out / "model.safetensors").stat().st_size / 2**20
    (out / "README.md").write_text(CARD.format(
        name=NAMES[arch], arch=arch, desc=desc, arch_line=arch_line, mib=mib,
        vocab=cfg["vocab_size"], tokens=info["tokens_seen"], ppl=info["heldout_ppl_fp32"],
        threads=info.get("threads", 2),
        **{k: v for k, v in info.items()
           if k not in ("arch", "tokens_seen", "threads", "schedule_steps")}))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    t = sub.add_parser("train")
    t.add_argument("--arch", choices=sorted(ARCHS), required=True)
    t.add_argument("--minutes", type=float, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--steps", type=int, help="train exactly this many steps (reproducible)")
    k = sub.add_parser("card")
    k.add_argument("--arch", choices=sorted(ARCHS), required=True)
    args = ap.parse_args()
    if args.cmd == "corpus":
        build_corpus(args.data_dir)
    elif args.cmd == "card":
        write_card(args.arch)
    else:
        train(args.arch, args.minutes, args.seed, args.lr, args.threads, args.steps)


if __name__ == "__main__":
    main()
