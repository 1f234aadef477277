"""The Python API: everything the ``dynquant`` command does, as functions that take what its
options take and return plain data. ``cli.py`` only maps arguments onto these calls.

The options of ``measure`` and ``quantize`` are their configurations: :class:`MeasureOptions`
(what to measure, with its :class:`Calibration` text) and :class:`QuantizeRequest`, whose
sections say what its own measurement measures, how widths are allocated
(:class:`AllocationOptions`), how codes are chosen (:class:`CodeOptions`) and where the work runs
(:class:`RunOptions`); each field is documented there and every default defined there once. A
call passes whole sections, or any field by its flat name (``calib``, ``calib_seqs``,
``calib_len`` for the calibration's)::

    from dynquant import api
    api.quantize("SmolLM2-135M", "out/q", budget=4.25, tuning=api.ScaleTuning(steps=50))
    api.quantize("SmolLM2-135M", "out/q", allocation=api.AllocationOptions(budget=4.25),
                 codes=api.CodeOptions(quantizer="gptq"), run=api.RunOptions(executor="ray"))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from dynquant.errors import DynquantError
from dynquant.format.planner import plan_document
from dynquant.format.widths_file import load_widths
from dynquant.models.sources import ModelSource, resolve_model
from dynquant.pipeline.allocate.allocation import (
    Allocation,
    Constraints,
    allocate_widths,
    parse_pins,
    uniform_widths,
    widths_mapping,
)
from dynquant.pipeline.allocate.forecast import Forecast, forecast, measure_summary, summary_lines
from dynquant.pipeline.allocate.maps import is_maps, load_maps, maps_modules, split_maps_arg
from dynquant.pipeline.codes.end_to_end import EndToEndTuning
from dynquant.pipeline.codes.tuned_scales import ScaleTuning
from dynquant.pipeline.config import AllocationOptions, Calibration, CodeOptions, RunOptions
from dynquant.pipeline.execute.scope import executor_scope
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure as _measure
from dynquant.pipeline.report.demo import run_demo
from dynquant.pipeline.report.evaluate import EvalResult
from dynquant.pipeline.report.evaluate import evaluate as _evaluate
from dynquant.pipeline.report.generate import generate_text
from dynquant.pipeline.workflow import QuantizeRequest, run_quantize

__all__ = ["Allocation", "AllocationOptions", "Calibration", "CodeOptions", "EndToEndTuning",
           "EvalResult", "Forecast", "MeasureOptions", "QuantizeRequest", "RunOptions",
           "ScaleTuning", "allocate", "demo", "evaluate", "generate",
           "measure", "measure_lines", "model", "plan", "quantize", "widths_json"]


def model(name: str | Path) -> ModelSource:
    """A model directory, config.json, preset or cached hub name, resolved (its tensors and
    config; no weight read)."""
    return resolve_model(str(name))


def plan(model_name: str | Path, widths: str | Path, *, group_size: int = 128,
         report: Callable[[Forecast], None] | None = None) -> dict:
    """``dynquant plan``: the dynquant.json a quantize with ``widths`` (a dynquant.json, a
    widths JSON, or ``MAPS.json:BUDGET``, allocated here and its forecast given to ``report``)
    would write, from the model's shapes alone."""
    source = model(model_name)
    chosen = _plan_widths(str(widths), report)
    return plan_document(source.tensor_specs(), chosen, model=str(model_name),
                         group_size=group_size, tied=source.tied, widths_from=str(widths))


def _plan_widths(arg: str, report: Callable[[Forecast], None] | None) -> dict:
    if not is_maps(arg):
        return load_widths(arg)
    path, budget = split_maps_arg(arg)
    if budget is None:
        raise DynquantError("a maps file needs a budget: MAPS.json:BUDGET", file=path,
                            field="budget")
    maps = load_maps(path)
    modules = maps_modules(maps)
    alloc = allocate_widths(modules, budget)
    if report is not None:
        report(forecast(maps, modules, budget, alloc=alloc))
    return dict(alloc.widths)  # module -> (bits, group size)


def measure(model_name: str | Path, output: str | Path | None = None, *,
            progress: bool = True, random_init: bool = False, executor=None,
            address: str | None = None, **options) -> dict:
    """``dynquant measure``: the maps document (written to ``output`` when given). ``options``:
    :class:`MeasureOptions`' fields (``calib=[]``: the text dynquant ships; ``method="weight"``:
    data-free; ``forecast_check``: the command's check of the forecast, on by default there);
    ``executor``: "local", "ray" (the cluster at ``address``, or a local Ray instance), or an
    ``Executor``."""
    opts = MeasureOptions.of(**_as_text(options))
    with executor_scope(executor, address) as runner:
        return _measure(model(model_name), opts, None if output is None else str(output),
                        progress, random_init, runner)


def measure_lines(doc: dict) -> tuple[dict, list[str]]:
    """A maps document's summary (sizes and predicted KL per budget, warnings) as data, and as
    the lines ``dynquant measure`` prints."""
    summary = measure_summary(doc)
    return summary, summary_lines(summary)


def allocate(maps: str | Path | dict, budget: float | None = None, *,
             uniform: int | None = None, pins: Sequence[str] = (), min_bits: int | None = None,
             max_bits: int | None = None, group_sizes: Sequence[int] | None = None
             ) -> Allocation:
    """``dynquant allocate``: the exact optimum at ``budget`` (or uniform widths)."""
    doc = maps if isinstance(maps, dict) else load_maps(maps)
    modules = maps_modules(doc)
    cons = Constraints(parse_pins(pins), min_bits, max_bits, group_sizes)
    if uniform is not None:
        return uniform_widths(modules, uniform, max(doc["group_sizes"]), cons)
    if budget is None:
        raise DynquantError("give a budget or uniform widths", field="budget")
    return allocate_widths(modules, budget, cons)


def widths_json(alloc: Allocation, maps: str | Path | dict) -> dict:
    """An allocation as the widths JSON ``dynquant allocate`` writes."""
    doc = maps if isinstance(maps, dict) else load_maps(maps)
    return widths_mapping(alloc, max(doc["group_sizes"]))


def quantize(model_name: str | Path, output: str | Path, **options) -> dict:
    """``dynquant quantize``: (measure ->) allocate -> quantize -> write; returns the metadata.
    ``options``: :class:`QuantizeRequest`'s sections, or their fields by name, e.g.
    ``budget=4.25``, ``quantizer=`` "auto"
    (tuned with calibration text, rtn data-free), "tuned", "gptq" or "rtn",
    ``tuning=ScaleTuning(steps=...)``, ``end_to_end=EndToEndTuning(steps=...)``,
    ``independent_blocks=True`` (every block's codes from the float model's hidden states: one
    job a block on a cluster), ``chain_blocks=K`` (chains of K blocks, each from the float
    model's hidden states at its first block: one job a chain), ``float_targets=1.0`` (GPTAQ,
    GPTQModel's ``v2``: each Linear's codes fitted to the float model's outputs),
    ``executor="ray"`` (the checkpoint is byte-identical on any executor), ``report`` (told the
    forecast before anything is written). An untied output head is quantized like any Linear;
    ``not_convert=["lm_head"]`` keeps it dense."""
    request = QuantizeRequest.of(str(output), **_as_text(options))
    return run_quantize(model(model_name), request)


def _as_text(options: dict) -> dict:
    """``options`` with their paths as the pipeline records them, strings: the calibration
    texts (``calib``) and a widths or maps file (``widths``)."""
    out = dict(options)
    if "calib" in out:
        out["calib"] = [str(c) for c in out["calib"]]
    if out.get("widths") is not None:
        out["widths"] = str(out["widths"])
    return out


def evaluate(model_path: str | Path, base: str | Path, text: str | Path, **options
             ) -> EvalResult:
    """``dynquant eval``: perplexity and KL(base || model) on ``text`` (``options``: ``ctx``,
    ``max_tokens``, ``progress``, ``dtype``, ``activations``, ``spread``)."""
    return _evaluate(model_path, base, text, **options)


def generate(checkpoint: str | Path, prompt: str, **options) -> str:
    """``dynquant generate``: the completion of ``prompt`` (``options``: ``max_new_tokens``,
    ``temperature``, ``seed``, ``stream``, ``dtype``, ``chat``, ``activations``)."""
    return generate_text(checkpoint, prompt, **options)


def demo(output: str | Path = "out/demo", dtype: str | None = None) -> None:
    """``dynquant demo``: the main job on the bundled default."""
    run_demo(output, dtype=dtype)
