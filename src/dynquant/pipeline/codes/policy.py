"""Which codes a quantize writes: ``--quantizer auto`` (the default) decides from the run's text
and model, ``rtn``, ``gptq`` and ``tuned`` are asked for; the sequential pass's calibration
windows. The one place that
decides and checks it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dynquant.errors import DynquantError
from dynquant.models.sources import ModelSource
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.calibrate.text import (
    BUNDLED_TEXT,
    calibration_blocker,
    calibration_ids,
    default_calibration,
)
from dynquant.pipeline.codes.code_chooser import SEQUENTIAL, check_quantizer
from dynquant.pipeline.codes.end_to_end import EndToEndTuning
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.tuned_scales import ScaleTuning


def check_request(requested: str, source: ModelSource, random_init: bool) -> None:
    """A quantize's ``--quantizer`` before any work: a known name, and for gptq a model that
    can run calibration text."""
    if requested != "auto":
        check_quantizer(requested)
    if requested in SEQUENTIAL and calibration_blocker(source, random_init) is not None:
        raise DynquantError(f"--quantizer {requested} needs model weights and a tokenizer (a "
                            "model directory) to calibrate with", file=source.name,
                            field="quantizer")


def choose_quantizer(requested: str, source: ModelSource, random_init: bool,
                     calib: Sequence[str], record: dict | None, say: bool = False) -> str:
    """The codes to write. ``auto``: tuned (gptq's codes with each block's scales tuned) when
    the run has calibration text (``calib``, or widths measured on the bundled text:
    ``record``, the maps' record of their text) and a model that can run it; round-to-nearest on
    the data-free path, and (with one line saying so when ``say``) for widths measured on a text
    not given again."""
    if requested != "auto":
        return requested
    texts = (record or {}).get("texts")
    if calibration_blocker(source, random_init) or not (calib or texts):
        return "rtn"
    if not calib and texts != [BUNDLED_TEXT]:
        if say:
            print(f"dynquant: rounding to nearest: the widths were measured on "
                  f"{', '.join(texts)}; give it with --calib for tuned codes", file=sys.stderr)
        return "rtn"
    return "tuned"


def gptq_calibration(source: ModelSource, calib: Sequence[str], record: dict | None,
                     seqs: int, length: int,
                     tuning: ScaleTuning | None = None,
                     end_to_end: EndToEndTuning | None = None,
                     chain: int = 0, dtype: str = "float32", float_targets: float = 0.0
                     ) -> SequentialCalibration:
    """The ``seqs`` windows of ``length`` tokens the sequential gptq pass streams: of
    ``calib``, else of the text the widths were measured on when that is dynquant's bundled
    text (or nothing was measured). The model can run them (``check_request`` /
    ``choose_quantizer`` made sure)."""
    texts = list(calib)
    if not texts:
        measured_on = (record or {}).get("texts", [BUNDLED_TEXT])
        if measured_on != [BUNDLED_TEXT]:
            raise DynquantError(f"--quantizer gptq: the widths were measured on "
                                f"{', '.join(measured_on)}; give that text again with --calib",
                                field="calib")
        texts = [str(default_calibration())]
    ids = calibration_ids(load_tokenizer(source.directory), texts, seqs, length)
    return SequentialCalibration(ids, tuning, end_to_end, chain, dtype, float_targets)
