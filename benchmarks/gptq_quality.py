"""Quality vs bytes: round-to-nearest, error-compensated (sequential GPTQ) and HQQ
codes, uniform and allocated, on every quality model. Mean KL against the unquantized model on
held-out text; checkpoint bytes. One table per model (printed as figures and as a markdown
table) and a plot of it: ``out/bench/quality_vs_bytes_MODEL.png``.

The widths come from one calibrated measure on the bundled text (``dynquant quantize
--budget``'s own; candidates priced with round-to-nearest, what ``--quantizer auto`` does), and
both quantizers write the same widths: equal bytes by construction. The allocated rows also get
GPTQ codes in widths priced with compensated errors (``measure --quantizer gptq``: the
allocator sees the codes it gets; "gptq-priced"). HQQ (group 128, a scale and
a zero per group) costs what dynquant's uniform width does. Targets: compensated <= 0.6x
round-to-nearest's KL at 3.25 and 4.25 bits, <= 0.5x at 2.5; quantize of a 100-300 M model
with calibration <= 5 minutes.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.common import figure, machine, quality_models
from benchmarks.quality_vs_hqq import hqq_model
from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.allocate.allocation import allocate_widths, uniform_widths
from dynquant.pipeline.allocate.maps import maps_modules
from dynquant.pipeline.calibrate.text import calibration_ids, default_calibration
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure
from dynquant.pipeline.report.evaluate import evaluate
from dynquant.pipeline.report.frontier import evaluate_checkpoints

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"
PLOTS = ROOT / "out" / "bench"
EVAL_TOKENS = 16384
BUDGETS = (2.5, 3.25, 4.25)
UNIFORM = (2, 3, 4)
GPTQ_SEQS = 48  # quantize --gptq-seqs's default


def gptq_windows(model_dir: Path):
    """The windows a default quantize's sequential pass streams: ``GPTQ_SEQS`` x 256 tokens of
    the bundled text."""
    return calibration_ids(load_tokenizer(model_dir), [str(default_calibration())], GPTQ_SEQS,
                           256)


def _widths(maps: dict, kind: str, value: float) -> dict:
    modules = maps_modules(maps)
    if kind == "uniform":
        return dict(uniform_widths(modules, int(value), 128).widths)
    return dict(allocate_widths(modules, value).widths)


def model_table(name: str, model_dir: Path, out: Path) -> list[dict]:
    """Rows (kind, setting, codes, bytes, KL) of one model."""
    source = resolve_model(str(model_dir))
    start = time.perf_counter()
    maps = measure(source, MeasureOptions(budgets=[]), out / "maps.json", progress=False)
    figure(f"{name}: calibrated measure (rtn-priced)", time.perf_counter() - start, "s")
    importance = load_file(out / maps["stats"])
    ids = gptq_windows(model_dir)
    start = time.perf_counter()
    priced = measure(source, MeasureOptions(budgets=[], quantizer="gptq"), out / "gptq.json",
                     progress=False)
    figure(f"{name}: calibrated measure (gptq-priced)", time.perf_counter() - start, "s")
    choosers = {"rtn": CodeChooser("rtn", importance),
                "gptq": CodeChooser("gptq", importance, sequential=SequentialCalibration(ids))}
    rows, names = [], []
    for kind, values in (("uniform", UNIFORM), ("allocated", BUDGETS)):
        for value in values:
            runs = [(codes, chooser, maps) for codes, chooser in choosers.items()]
            if kind == "allocated":
                runs.append(("gptq-priced", choosers["gptq"], priced))
            for codes, chooser, widths_from in runs:
                tag = f"{codes}-{kind}-{value}"
                start = time.perf_counter()
                doc = quantize_model(source, _widths(widths_from, kind, value), out / tag,
                                     overwrite=True, progress=False, chooser=chooser)
                figure(f"{name} {kind} {value}: {codes} quantize time",
                       time.perf_counter() - start, "s")
                rows.append({"kind": kind, "setting": value, "codes": codes, "tag": tag,
                             "nbytes": doc["accounting"]["total_nbytes"]})
                names.append(tag)
    results = evaluate_checkpoints(model_dir, out, names, HELDOUT, 512, EVAL_TOKENS, None)
    for row in rows:
        row["kl"] = results[row["tag"]].kl_mean
    for bits in UNIFORM:
        hqq = evaluate(hqq_model(model_dir, bits, out / f"hqq{bits}"), model_dir, HELDOUT,
                       progress=False, max_tokens=EVAL_TOKENS)
        nbytes = next(r["nbytes"] for r in rows if r["tag"] == f"rtn-uniform-{bits}")
        rows.append({"kind": "uniform", "setting": bits, "codes": "hqq", "tag": f"hqq{bits}",
                     "nbytes": nbytes, "kl": hqq.kl_mean})
    return rows


def report(name: str, rows: list[dict]) -> None:
    by = {(r["kind"], r["setting"], r["codes"]): r for r in rows}
    print(f"\n| {name} | bytes (MiB) | RTN KL | GPTQ KL | GPTQ / RTN | GPTQ, gptq-priced "
          f"(MiB, KL, / RTN) | HQQ KL |")
    print("|---|---|---|---|---|---|---|")
    for kind, values in (("uniform", UNIFORM), ("allocated", BUDGETS)):
        for v in values:
            rtn, gptq, priced, hqq = (by.get((kind, v, c))
                                      for c in ("rtn", "gptq", "gptq-priced", "hqq"))
            ratio = gptq["kl"] / rtn["kl"]
            figure(f"{name} {kind} {v}: KL gptq / rtn", ratio, "x")
            cell = "-"
            if priced is not None:
                figure(f"{name} {kind} {v}: KL gptq (gptq-priced) / rtn",
                       priced["kl"] / rtn["kl"], "x")
                cell = (f"{priced['nbytes'] / 2**20:.2f}, {priced['kl']:.4f}, "
                        f"{priced['kl'] / rtn['kl']:.2f}x")
            print(f"| {kind} {v} | {rtn['nbytes'] / 2**20:.2f} | {rtn['kl']:.4f} | "
                  f"{gptq['kl']:.4f} | {ratio:.2f}x | {cell} | "
                  f"{'-' if hqq is None else format(hqq['kl'], '.4f')} |")


def plot(name: str, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    styles = {("rtn", "uniform"): "s--", ("gptq", "uniform"): "o--", ("hqq", "uniform"): "^:",
              ("rtn", "allocated"): "s-", ("gptq", "allocated"): "o-",
              ("gptq-priced", "allocated"): "d-"}
    for (codes, kind), style in styles.items():
        pts = sorted((r["nbytes"] / 2**20, r["kl"]) for r in rows
                     if r["codes"] == codes and r["kind"] == kind)
        ax.plot(*zip(*pts, strict=True), style, label=f"{codes} {kind}")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint MiB")
    ax.set_ylabel("mean KL vs the float model (held-out)")
    ax.set_title(f"{name}: quality vs bytes")
    ax.legend(fontsize=8)
    PLOTS.mkdir(parents=True, exist_ok=True)
    path = PLOTS / f"quality_vs_bytes_{name}.png"
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def main() -> None:
    print(f"# quality vs bytes: RTN, sequential GPTQ, HQQ; held-out text, {machine()}")
    for name, model_dir in quality_models(ROOT).items():
        with tempfile.TemporaryDirectory() as tmp:
            rows = model_table(name, Path(model_dir), Path(tmp))
        report(name, rows)
        print(f"plot: {plot(name, rows)}")
        PLOTS.mkdir(parents=True, exist_ok=True)
        (PLOTS / f"quality_vs_bytes_{name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
