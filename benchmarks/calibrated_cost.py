"""The calibrated default's cost model: `quantize --budget` with text (16 x 256 windows for the
measure's X^T X, 48 for the codes: GPTQ's with each block's scales tuned) of 8 B, 70 B and
235 B-A22B models on 1, 8 and 64 workers, projected from the per-stage rates that
``benchmarks/scale.py`` measures at a 7 B layer's shapes (one worker = the measuring machine's
threads; the driver the same).

Per decoder block, in order, as the pipeline runs it (docs/distributed.md):
- the X^T X pass: the block's forwards and second moments, by shards of 8 windows (16
  windows: 2 jobs a block); on a cluster they are submitted without waiting and the next
  block's inputs come from forward jobs of one window, so only the forward is a chain;
- the statistics pass (8 windows, a window a job) and the Fisher pass's backward (the same
  windows, ``CLUSTER_SHARD_SEQS`` a job on the workers);
- the measure's gptq ratios: one job per Linear (an inverse factor and a few rows compensated),
  submitted as the X^T X pass sums the block's moments and waiting on no later block (at the
  pass's measured rate, which includes them);
- the sequential GPTQ pass, a group at a time (q/k/v, o, gate/up, down): the group's partial
  forwards and X^T X by shards, then its inverse factor(s) on the driver (one per distinct input;
  one per expert for a bank: the Cholesky must round the same on every run), then its matrices'
  compensation as jobs (a bank: one per expert); then (the default, tuned codes) the float
  block's outputs on the float model's hidden states (the targets, by shards), the block's
  scales tuned there (``ScaleTuning().steps`` steps of one window, forward and backward: each
  step needs the one before) and the tuned codes' outputs by shards; the GPTQ codes' outputs
  only on the tuning's ``check_windows``. With ``--tune-on float``
  the pass computes only the targets (by shards); each block's tuning is a job on a worker
  beside the pass (its steps and its two forwards on the check windows), and the run ends when the pass
  has ended and the last block's tuning is back (or when the workers have done every block's,
  if that is later: counted as if the pass's own jobs left them idle, which at 64 workers they
  mostly do; on one worker one after the other). With ``--chain-blocks K`` the pass is only
  the float model's outputs (by shards) and each chain of K blocks a job of its own (each
  block's GPTQ and tuning, and its tuned codes' output for the next but the chain's last),
  counted the same way; ``--independent-blocks`` is K = 1.
Then the output head once (its factor and its vocabulary-wide compensation), and for a model
of at most ``AUTO_MAX_WEIGHTS`` quantized weights the end-to-end scales on the driver
(``end_to_end_work``). Not counted: moving
the windows' hidden states to the workers (48 x 256 positions x hidden x 4 B per group: 400 MB
at 8,192 wide), the data-free measure's candidates, Ray's start.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dynquant.pipeline.calibrate.fisher import CLUSTER_SHARD_SEQS
from dynquant.pipeline.codes.end_to_end import (
    AUTO_MAX_WEIGHTS,
    AUTO_STEPS,
    HELD_WEIGHTS_BYTES,
    validation_windows,
)
from dynquant.pipeline.codes.sequential_gptq import OUTPUT_SHARD_SEQS
from dynquant.pipeline.codes.tuned_scales import ScaleTuning, check_windows
from dynquant.pipeline.measure.options import MeasureOptions

WINDOWS, MOMENT_WINDOWS, WINDOW, SHARD, STAT_WINDOWS = 48, 16, 256, 8, 8
RATIO_ROWS = 256  # rows a gptq ratio compensates, at each of 4 widths
CHAINS = (4, 2, 1)  # --chain-blocks columns (1: --independent-blocks)
TUNING = "scale tuning (driver)"
TARGETS = "the float model's outputs (workers)"
JOBS = "jobs beside the pass, after it (workers)"
END_TO_END = "end-to-end scales (driver)"
# a block's Fisher pass in forwards' multiply-adds: its forward, its taps' x dW^T (a forward's
# products), and an input-gradient backward (a forward's) for each label draw
FISHER_FORWARDS = 2 + MeasureOptions().fisher_draws


@dataclass(frozen=True)
class Shape:
    """A decoder model's shapes (``q``/``kv``: the attention projections' widths; a MoE's
    ``experts`` of ``expert_mlp`` each, ``active`` per token)."""

    name: str
    layers: int
    hidden: int
    mlp: int
    q: int
    kv: int
    vocab: int
    experts: int = 0
    active: int = 0

    def linears(self) -> list[tuple[int, int, int]]:
        """(rows, inputs, copies) of one block's matrices (copies: a bank's experts)."""
        h, e = self.hidden, max(self.experts, 1)
        return [(self.q + 2 * self.kv, h, 1), (h, self.q, 1),
                (2 * self.mlp, h, e), (h, self.mlp, e)]


SEVEN_B = Shape("7B layer (Qwen2-7B)", 1, 3584, 18944, 3584, 512, 49152)
MODELS = [Shape("8B (Llama-3-8B)", 32, 4096, 14336, 4096, 1024, 128256),
          Shape("70B (Llama-3-70B)", 80, 8192, 28672, 8192, 1024, 128256),
          Shape("235B-A22B (Qwen3)", 94, 4096, 1536, 8192, 512, 151936, 128, 8)]
WORKERS = (1, 8, 64)


def block_work(s: Shape, tokens: int) -> dict[str, float]:
    """Multiply-adds of one block over ``tokens``: ``forward``, ``moments`` (X^T X of each
    distinct input as symmetric updates; a MoE's experts over their routed tokens),
    ``partial`` (the GPTQ pass's extra partial forwards), ``factors`` (Cholesky + triangular
    inverse, n^3/3 per distinct input), ``compensate`` (rows x inputs^2 / 2 per matrix),
    ``largest_compensate`` (the largest single job), ``ratios`` (the measure's gptq ratios)."""
    routed = s.active if s.experts else 1
    (qkv_r, h, _), (o_r, o_in, _), (gu_r, _, e), (d_r, m, _) = s.linears()
    attn, mlp = qkv_r * h + o_r * o_in, routed * (gu_r * h + d_r * m)
    forward = tokens * (attn + mlp)
    moments = tokens * (h * h + o_in * o_in + routed * (h * h + m * m)) / 2
    partial = tokens * (3 * qkv_r * h + 2 * o_r * o_in + routed * gu_r * h)
    factors = (h ** 3 + o_in ** 3 + e * (h ** 3 + m ** 3)) / 3
    jobs = [r * n * n / 2 for r, n, _ in s.linears()]
    compensate = sum(j * c for j, (_, _, c) in zip(jobs, s.linears(), strict=True))
    # a ratio per tensor (q, k, v, o, gate, up, down): its own factor, 256 rows at 4 widths
    ratio_jobs = [n ** 3 / 3 + 4 * RATIO_ROWS * n * n / 2 for n in (h, h, h, o_in, h, h, m)]
    return {"forward": forward, "moments": moments, "partial": partial, "factors": factors,
            "compensate": compensate, "largest_compensate": max(jobs),
            "ratios": sum(ratio_jobs), "largest_ratio": max(ratio_jobs)}


def tuning_work(s: Shape) -> float:
    """Multiply-adds of tuning one block's scales (the default codes): ``ScaleTuning().steps``
    steps of one window each, forward and backward (the input's and the weights' gradients:
    3 forwards' products)."""
    return 3 * ScaleTuning().steps * block_work(s, WINDOW)["forward"]


def quantized_weights(s: Shape) -> int:
    """The weights a quantize of the model packs: every block's matrices, the embedding and the
    untied head."""
    return s.layers * sum(r * n * c for r, n, c in s.linears()) + 2 * s.vocab * s.hidden


def end_to_end_work(s: Shape) -> float:
    """Multiply-adds of the end-to-end scales (the default for tuned codes up to
    ``AUTO_MAX_WEIGHTS``): the float model's distributions over every window (its head on
    the last block's outputs, which the sequential pass of tuned codes has made), ``AUTO_STEPS``
    steps of one window (forward and backward: 3 forwards' products, the blocks' 4 where their
    weights pass ``HELD_WEIGHTS_BYTES`` and each is run again), the held-out windows before
    and after; a forward of a token is every block's products (a MoE's routed experts) and
    the head's."""
    routed = s.active if s.experts else 1
    (qkv_r, h, _), (o_r, o_in, _), (gu_r, _, _), (d_r, m, _) = s.linears()
    blocks = s.layers * (qkv_r * h + o_r * o_in + routed * (gu_r * h + d_r * m))
    in_blocks = s.layers * sum(r * n * c for r, n, c in s.linears())
    passes = 4 if in_blocks * 4 > HELD_WEIGHTS_BYTES else 3
    held_out = 2 * validation_windows(WINDOWS)
    return WINDOW * ((AUTO_STEPS * passes + held_out) * blocks
                     + (WINDOWS + AUTO_STEPS * 3 + held_out) * s.vocab * s.hidden)


def head_work(s: Shape) -> dict[str, float]:
    """The output head's factor and compensation (once), and its logits over the Fisher
    pass's windows (per position: vocabulary x hidden)."""
    return {"factor": s.hidden ** 3 / 3, "compensate": s.vocab * s.hidden ** 2 / 2,
            "logits": STAT_WINDOWS * WINDOW * s.vocab * s.hidden}


def project(s: Shape, workers: int, rate: dict[str, float], mode: str = "quantized",
            chain: int = 0) -> dict[str, float]:
    """Seconds of each part of the run on ``workers`` (rates in multiply-adds per second:
    ``pass``, ``stats``, ``fisher`` (``FISHER_FORWARDS`` forwards of the backward's windows),
    ``fisher_head`` (logits per s), ``gptq``, ``factor``; ``tune``: the tuning steps',
    for tuned codes; ``e2e``: the end-to-end scales', run for tuned codes up to
    ``AUTO_MAX_WEIGHTS`` quantized weights where measured). ``mode``: the default
    ("quantized") or ``--tune-on float`` ("float"); ``chain`` K > 0: ``--chain-blocks K``."""
    big, small = block_work(s, WINDOWS * WINDOW), block_work(s, STAT_WINDOWS * WINDOW)
    measured = block_work(s, MOMENT_WINDOWS * WINDOW)
    head = head_work(s)
    spread = min(workers, WINDOWS // SHARD)  # X^T X jobs a block
    wide = min(workers, WINDOWS // OUTPUT_SHARD_SEQS)  # output jobs a block (nothing folded)
    outputs = big["forward"] / rate["gptq"] / wide
    checked = len(check_windows(WINDOWS)) / WINDOWS  # the windows a tuning is compared on
    tuned = "tune" in rate
    # the X^T X pass: here its shards one after the other; on a cluster only its forward (a
    # window a job) is a chain over the blocks, the X^T X jobs (forward and moments) wait on
    # nothing after it: the blocks' spread over the workers, the last block's one shard after
    moments = (measured["forward"] + measured["moments"]) / rate["pass"]  # a block's work
    xtx = moments * s.layers if workers == 1 else (
        max(measured["forward"] / rate["pass"] / min(workers, MOMENT_WINDOWS) * s.layers,
            moments * s.layers / workers) + moments / (MOMENT_WINDOWS // SHARD))
    measure = {  # per block, but the X^T X pass's whole
        "statistics (workers)": small["forward"] / rate["stats"] / min(workers, STAT_WINDOWS),
        "Fisher backward (workers)": FISHER_FORWARDS * small["forward"] / rate["fisher"]
        / min(workers, STAT_WINDOWS // CLUSTER_SHARD_SEQS),
    }
    gptq = {  # the sequential pass, one block after the other
        "GPTQ forwards + X^T X (workers)": (big["partial"] + big["moments"]) / rate["gptq"]
        / spread + outputs * (checked if tuned and mode == "quantized" else 1),
        "inverse factors (driver)": big["factors"] / rate["factor"],
        "compensation (workers)": max(big["compensate"] / workers, big["largest_compensate"])
        / rate["gptq"],
    }
    # one block's tuning job: the steps, its two forwards on the check windows
    tune = (tuning_work(s) / rate["tune"] + 2 * checked * big["forward"] / rate["gptq"]
            if tuned else 0.0)
    targets = {TARGETS: outputs}  # the float model's, by shards
    jobs = s.layers  # jobs beside the pass
    if chain:  # on the pass only the float model's outputs; a job per chain of blocks
        passed = targets  # (its GPTQ on one worker, the chain's last output not needed)
        job = chain * ((big["partial"] + big["moments"] + big["compensate"]) / rate["gptq"]
                       + big["factors"] / rate["factor"] + tune) + (chain - 1) * big[
                           "forward"] / rate["gptq"]
        jobs = -(-s.layers // chain)
    elif mode == "float":  # the pass and the targets; the tuning a job per block beside it
        passed, job = {**gptq, **targets}, tune
    else:  # the targets, the steps (each needs the one before), the tuned outputs by shards
        passed = {**gptq, TUNING: 2 * outputs + tuning_work(s) / rate["tune"]} if tune else gptq
        job = 0.0
    out = {"X^T X pass (workers)": xtx,
           **{k: v * s.layers for k, v in {**measure, **passed}.items()}}
    if job and workers == 1:  # the one worker runs the pass's jobs too: one after the other
        out[JOBS] = job * jobs
    elif job:  # what the last job, or all the jobs, add after the pass
        out[JOBS] = max(0.0, job * jobs / workers - sum(passed.values()) * s.layers) + job
    # the ratios' jobs wait on no block: the whole model's spread over the workers
    out["gptq ratios (workers)"] = max(big["ratios"] * s.layers / workers,
                                       big["largest_ratio"]) / rate["pass"]
    out["head (driver)"] = (head["factor"] / rate["factor"] + head["compensate"] / rate["gptq"]
                            + head["logits"] / rate["fisher_head"])
    if tuned and "e2e" in rate and quantized_weights(s) <= AUTO_MAX_WEIGHTS:
        out[END_TO_END] = end_to_end_work(s) / rate["e2e"]
    return out


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def print_cost_model(rate: dict[str, float]) -> None:
    """The projection table: each part's hours and the whole, per model and worker count (and,
    for tuned codes, the whole with ``--tune-on float``, with ``--chain-blocks`` 4 and 2, with
    ``--independent-blocks``, without
    the tuning or the end-to-end scales: ``--quantizer gptq``, and, where their rate is
    measured, with the end-to-end scales: ``--e2e-steps 40``)."""
    parts = list(dict.fromkeys(k for s in MODELS for k in project(s, 1, rate)))
    tuned = TUNING in parts
    asked = tuned and "e2e" in rate  # the end-to-end scales' rate: their column
    extra = (" --tune-on float | --chain-blocks 4 | --chain-blocks 2 | --independent-blocks |"
             " --quantizer gptq |" if tuned else ""
             ) + (" --e2e-steps 40 |" if asked else "")
    print("| model | workers | " + " | ".join(parts) + " | **projected wall** | on the driver |"
          + extra)
    print("|---|---|" + "---|" * len(parts) + "---|---|" + "---|" * extra.count("|"))
    for s in MODELS:
        for w in WORKERS:
            p = project(s, w, rate)
            total = sum(p.values())
            driver = sum(v for k, v in p.items() if "driver" in k)
            # the tuned codes' other schedules; a gptq run has no tuning to move or leave out
            others = [sum(project(s, w, rate, "float").values())] + [
                sum(project(s, w, rate, chain=k).values()) for k in CHAINS] if tuned else []
            gptq = total - p.get(TUNING, 0.0) - p.get(END_TO_END, 0.0)
            e2e = end_to_end_work(s) / rate["e2e"] if asked else 0.0
            print(f"| {s.name} | {w} | "
                  + " | ".join(_duration(p[k]) if k in p else "-" for k in parts)
                  + f" | **{_duration(total)}** | {driver / total:.0%} |"
                  + ("".join(f" {_duration(t)} |" for t in others)
                     + f" {_duration(gptq)} |" if tuned else "")
                  + (f" {_duration(total - p.get(END_TO_END, 0.0) + e2e)} |" if asked else ""))


def main() -> None:
    """The table from per-worker rates as the scale benchmark prints them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rates", help="GMAC/s, e.g. 'pass 68.0, stats 95.5, ...' (the scale "
                        "benchmark's 'per-worker rates' line)")
    args = parser.parse_args()
    rate = {k: float(v) * 1e9 for k, v in
            (item.split() for item in args.rates.split(",") if item.strip())}
    print_cost_model(rate)


if __name__ == "__main__":
    main()
