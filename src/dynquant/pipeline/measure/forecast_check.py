"""The forecast's check: checkpoints quantized and measured during the measure.

The forecast adds up each module's predicted KL, and the modules' errors do not add up that way
in the written model: compounding through the blocks makes the sum low (SmolLM2's gptq codes),
a second-order estimate of a large perturbation makes it high (Gemma-3's tied embedding at 3
bits), and a noisy estimate of the module that holds most of the loss can make it low at
another size (the same embedding at 4 bits: half its exact KL); the figures are in
BENCHMARKS.md "Large vocabularies". So the measure quantizes the model as ``quantize`` would at
two sizes, the bytes of every module at the probe width (3 bits) and one bit per weight more
(those of 4 bits): at each, the widths allocated for those bytes (an allocation like the ones
forecast: uniform widths would leave the most sensitive modules at 3 bits, and their KL would
set the check's), with the codes asked for fitted to ``CHECK_SEQS`` windows of the first
``1 - HELD_SHARE`` of the calibration text, and measures its KL against the float model on
windows of the rest, which the codes never saw. ``forecast_check`` in maps.json keeps each
point's two numbers; forecasts scale their sums by the points' ratios
(``pipeline/allocate/forecast.py``, ``calibrated_kl``). The KL runs the float model and the
check's checkpoint a decoder block at a time (``pipeline/measure/streamed_kl.py``): a block of
each in memory, not the two whole models.

The check's codes are gptq's by default (``MeasureOptions.check_codes``): quantize's default
tuned codes start from them and keep what lowers each block's error, so their forecast is a
bound from above for the tuned codes, at about a quarter of a tuned check's time. Fitted to
``CHECK_SEQS`` windows, half of quantize's 48, the check's codes measure a few per cent more KL
than quantize's: the check errs high, by less than its noise, for less time (both measured in
BENCHMARKS.md "Calibration windows").
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from dynquant.models.sources import ModelSource
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.allocate.allocation import (
    AllocationError,
    allocate_widths,
    uniform_widths,
)
from dynquant.pipeline.allocate.maps import maps_modules
from dynquant.pipeline.calibrate.text import calibration_tokens, spread_windows
from dynquant.pipeline.calibrate.weights import weight_source
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.tuned_scales import ScaleTuning, default_pass_dtype
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.execute.executor import Executor
from dynquant.pipeline.measure.streamed_kl import streamed_kl

HELD_SHARE = 0.25  # of the calibration text's tokens: the check's held-out windows
CHECK_SEQS = 24  # the check's sequential pass's windows (quantize's: 48, --gptq-seqs)
MIN_HELD_WINDOWS = 2
STEPS = (0, 1)  # bits per weight above the probe width's bytes: the check's points


def split_windows(tokenizer, files: list[str], length: int, seqs: int = CHECK_SEQS
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(``seqs`` windows evenly spread over the first ``1 - HELD_SHARE`` of the text's tokens,
    the non-overlapping windows of the rest); None when the rest holds fewer than
    ``MIN_HELD_WINDOWS``."""
    ids = calibration_tokens(tokenizer, files)
    cut = int(len(ids) * (1 - HELD_SHARE))
    held = (len(ids) - cut) // length
    if held < MIN_HELD_WINDOWS or cut < length:
        return None
    return (spread_windows(ids[:cut], seqs, length),
            ids[cut : cut + held * length].reshape(held, length))


def forecast_check(source: ModelSource, doc: dict, importance: dict[str, torch.Tensor],
                   calib: list[str], length: int, bits: int, group_size: int,
                   work: Path, executor: Executor | None = None, progress: bool = False,
                   codes: str = "gptq", tuning: ScaleTuning | None = None) -> dict | None:
    """Quantize ``source`` with ``codes`` (gptq or tuned) at the widths allocated for the bytes of ``bits``
    everywhere, and for those bytes plus each further step of ``STEPS``, and measure each on
    held-out windows of the calibration text: ``{"codes", "held_tokens", "points": [{"widths",
    "predicted_kl", "measured_kl"}, ...]}`` (a point the modules cannot be allocated at is left
    out), or None when the text is too short or a module has no candidate at that width."""
    windows = split_windows(load_tokenizer(source.directory), calib, length)
    modules = maps_modules(doc, "gptq")
    try:
        uniform = uniform_widths(modules, bits, group_size)
    except AllocationError:
        return None
    if windows is None:
        return None
    fit, held = windows
    dtype = default_pass_dtype(tuning, uniform.elements)
    tuning = (tuning or ScaleTuning()).resolved(dtype, uniform.elements)
    probe_budget = uniform.packed_nbytes * 8 / uniform.elements
    points = []
    for step in STEPS:
        try:
            alloc = allocate_widths(modules, probe_budget + step)
        except AllocationError:
            continue
        if alloc.predicted_error <= 0:
            continue
        measured = _measured_kl(source, doc, importance, dict(alloc.widths), fit, held,
                                group_size, work, executor, progress, codes,
                                tuning, dtype)
        points.append({"widths": f"allocated at uniform {bits}:{group_size}'s bytes"
                       + (f" + {step} bit per weight" if step else ""),
                       "predicted_kl": alloc.predicted_error, "measured_kl": measured})
    if not points:
        return None
    return {"codes": codes, "held_tokens": held.numel(), "points": points}


def _measured_kl(source: ModelSource, doc: dict, importance: dict[str, torch.Tensor],
                 widths: dict, fit: torch.Tensor, held: torch.Tensor, group_size: int,
                 work: Path, executor: Executor | None, progress: bool, codes: str,
                 tuning: ScaleTuning, dtype: str) -> float:
    """The KL on ``held`` of ``source`` quantized at ``widths`` with ``codes`` fitted to
    ``fit`` (the pass in ``dtype``)."""
    chooser = CodeChooser(codes, importance, sequential=SequentialCalibration(
        fit, tuning if codes == "tuned" else None, dtype=dtype))
    with tempfile.TemporaryDirectory(prefix=".forecast-check-", dir=work) as tmp:
        quantize_model(source, widths, Path(tmp) / "check", group_size=group_size,
                       modules_to_not_convert=tuple(doc["modules_to_not_convert"]),
                       chooser=chooser, progress=progress, executor=executor)
        return streamed_kl(source, weight_source(source, random_init=False), Path(tmp) / "check",
                           held, "forecast check: KL on held-out windows", progress)
