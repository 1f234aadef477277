"""The Python API, mirroring the CLI: ``measure``, ``allocate``, ``quantize``.

Each takes what the command line takes (paths, presets, numbers) and returns plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dynquant.models.sources import resolve_model
from dynquant.pipeline.allocate.allocation import (
    Allocation,
    Constraints,
    allocate_widths,
    parse_pins,
    uniform_widths,
)
from dynquant.pipeline.allocate.maps import load_maps, maps_modules
from dynquant.pipeline.codes.end_to_end import EndToEndTuning
from dynquant.pipeline.codes.tuned_scales import ScaleTuning
from dynquant.pipeline.execute.executor import Executor
from dynquant.pipeline.execute.scope import executor_scope
from dynquant.pipeline.measure.options import DEFAULT_BUDGETS, DEFAULT_WIDTHS, MeasureOptions
from dynquant.pipeline.measure.run import measure as _measure
from dynquant.pipeline.workflow import QuantizeRequest, run_quantize


def measure(model: str | Path, output: str | Path | None = None, *,
            calib: Sequence[str | Path] = (), method: str | None = None,
            widths: Sequence[int] = DEFAULT_WIDTHS, group_sizes: Sequence[int] = (128,),
            budgets: Sequence[float] = DEFAULT_BUDGETS, not_convert: Sequence[str] = (),
            calib_seqs: int = 8, calib_len: int = 256, random_init: bool = False,
            progress: bool = True, dtype: str = "float32", quantizer: str = "rtn",
            executor: str | Executor | None = None, address: str | None = None) -> dict:
    """``dynquant measure``: the maps document (written to ``output`` when given). Without
    ``calib`` it calibrates on the text dynquant ships (``method="weight"``: data-free).
    ``dtype``: the calibration passes' compute dtype (float32 by default on every CPU);
    ``quantizer``: price the candidates with round-to-nearest ("rtn") or GPTQ codes;
    ``executor``: where the modules' candidates are computed ("local", "ray" on the cluster at
    ``address`` or a local Ray instance, or an ``Executor``)."""
    opts = MeasureOptions(widths=widths, group_sizes=group_sizes, budgets=budgets,
                          method=method, calib=[str(c) for c in calib], calib_seqs=calib_seqs,
                          calib_len=calib_len, not_convert=not_convert, dtype=dtype,
                          quantizer=quantizer)
    with executor_scope(executor, address) as runner:
        return _measure(resolve_model(str(model)), opts, output, progress, random_init, runner)


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
        raise ValueError("give a budget or uniform=BITS")
    return allocate_widths(modules, budget, cons)


def quantize(model: str | Path, output: str | Path, *, budget: float | None = None,
             widths: str | Path | None = None, uniform: int | None = None,
             calib: Sequence[str | Path] = (), method: str | None = None,
             group_size: int = 128, group_sizes: Sequence[int] | None = None,
             pins: Sequence[str] = (), not_convert: Sequence[str] = (),
             random_init: bool = False, overwrite: bool = False,
             progress: bool = True, quantizer: str = "auto", tune_steps: int = ScaleTuning.steps,
             e2e_steps: int = EndToEndTuning.steps, executor: str | Executor | None = None,
             address: str | None = None) -> dict:
    """``dynquant quantize``: (measure ->) allocate -> quantize -> write; returns the metadata.
    ``quantizer``: "gptq" (error-compensating, sequential over the blocks, on the calibration
    text), "tuned" (gptq's codes with each block's scales and offsets tuned against the float
    block, ``tune_steps`` steps a block; then, with ``e2e_steps``, every scale and offset tuned
    against the whole float model), "rtn" (round-to-nearest with the clip search), "auto"
    (tuned when calibrating on text, rtn on the data-free path). ``executor``: where the
    per-module work runs ("local", "ray" on the cluster at ``address`` or a local Ray
    instance, or an ``Executor``): the checkpoint is byte-identical either way. An untied
    output head is quantized like any Linear; ``not_convert=["lm_head"]`` keeps it dense."""
    req = QuantizeRequest(output=str(output), widths=None if widths is None else str(widths),
                          budget=budget, uniform=uniform, calib=[str(c) for c in calib],
                          method=method, group_size=group_size, group_sizes=group_sizes,
                          pins=pins, not_convert=not_convert,
                          random_init=random_init, overwrite=overwrite, progress=progress,
                          quantizer=quantizer, tuning=ScaleTuning(steps=tune_steps),
                          end_to_end=EndToEndTuning(steps=e2e_steps),
                          executor=executor, address=address)
    return run_quantize(resolve_model(str(model)), req)
