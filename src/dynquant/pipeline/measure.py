"""measure -> maps.json: per module and candidate width, exact bytes and the error obtained, plus
a sensitivity per module, so that predicted dKL = sum_m sensitivity_m * error_m.

Sensitivity methods:
- ``kl`` (needs calibration text): the module alone is replaced by its 3-bit quantized weights;
  the mean KL(base || perturbed) of the next-token distribution on the calibration tokens,
  divided by that module's relative error, is its sensitivity (the first-order model
  KL ~ s * ||dW||^2 / ||W||^2 holds for small perturbations).
- ``weight`` (data-free proxy, the default without text): sensitivity = usage * ||W||^2, i.e.
  the cost is the absolute squared weight error a token meets; usage is top_k / E for routed
  expert banks, 1 / vocab for an untied input embedding (a token reads one row) and 1 otherwise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress
from torch import nn

from dynquant.errors import DynquantError
from dynquant.format.layout import LayerLayout
from dynquant.format.planner import TensorSpec, excluded_modules
from dynquant.models.sources import ModelSource
from dynquant.numerics.quantizer import quantize_tensor, relative_error, squared_norm
from dynquant.pipeline.allocate import (
    AllocationError,
    Candidate,
    Constraints,
    ModuleChoices,
    allocate_widths,
    widths_mapping,
)

MAPS_SCHEMA = "dynquant_maps_v1"
DEFAULT_WIDTHS = (2, 3, 4, 8)
DEFAULT_BUDGETS = (2.5, 3.0, 3.25, 3.5, 4.25)
PROBE_BITS = 3


@dataclass
class MeasureOptions:
    widths: Sequence[int] = DEFAULT_WIDTHS
    group_sizes: Sequence[int] = (128,)
    budgets: Sequence[float] = DEFAULT_BUDGETS
    method: str | None = None  # None: kl with calibration text, else weight
    calib: Sequence[str] = ()
    calib_seqs: int = 8
    calib_len: int = 256
    not_convert: Sequence[str] = ()
    # The kl probe's compute dtype. float32 by default on every CPU: sensitivities are
    # differences of small KLs, and bf16 rounding of activations would be noise of their size.
    dtype: str = "float32"


def module_candidates(weight: torch.Tensor, widths: Sequence[int], group_sizes: Sequence[int],
                      importance: torch.Tensor | None) -> list[Candidate]:
    out = []
    for gs in group_sizes:
        for bits in widths:
            qt = quantize_tensor(weight, bits, gs, importance=importance)
            err = relative_error(weight, qt, importance)
            out.append(Candidate(bits, gs, qt.nbytes, err))
    return out


def weight_usage(spec: TensorSpec, source: ModelSource) -> float:
    cfg = source.config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if len(spec.shape) == 3 and experts:
        return getattr(cfg, "num_experts_per_tok", 1) / experts
    if spec.module.endswith("embed_tokens") and not source.tied:
        return 1.0 / spec.shape[0]
    return 1.0


class KLProbe:
    """Mean KL(base || model with one module replaced) on calibration tokens."""

    def __init__(self, model: nn.Module, ids: torch.Tensor) -> None:
        self.model, self.ids = model, ids
        with torch.no_grad():
            self.base = [torch.log_softmax(model(row[None]).logits[0].float(), -1)
                         for row in ids]

    def kl_with(self, name: str, weight: torch.Tensor) -> float:
        param = _parameter(self.model, name)
        saved = param.data
        param.data = weight.to(saved.dtype).reshape(saved.shape)
        try:
            with torch.no_grad():
                kls = [(b.exp() * (b - torch.log_softmax(self.model(row[None]).logits[0]
                                                         .float(), -1))).sum(-1).mean()
                       for row, b in zip(self.ids, self.base, strict=True)]
        finally:
            param.data = saved
        return float(torch.stack(kls).mean())


def _parameter(model: nn.Module, module: str) -> nn.Parameter:
    try:
        return model.get_parameter(module)
    except AttributeError:
        return model.get_parameter(f"{module}.weight")


def allocations(modules: list[ModuleChoices], budgets: Sequence[float], group_size: int,
                constraints: Constraints | None = None) -> dict:
    out = {}
    for budget in budgets:
        try:
            alloc = allocate_widths(modules, budget, constraints)
        except AllocationError as exc:
            out[str(budget)] = {"error": exc.message}
            continue
        out[str(budget)] = {"widths": widths_mapping(alloc, group_size),
                            "packed_nbytes": alloc.packed_nbytes,
                            "average_bits": alloc.average_bits,
                            "predicted_error": alloc.predicted_error}
    return out


def maps_modules(maps: dict) -> list[ModuleChoices]:
    """The allocator's view of a maps document."""
    return [ModuleChoices(name, m["elements"], m["sensitivity"],
                          [Candidate(c["bits"], c["group_size"], c["nbytes"], c["error"])
                           for c in m["candidates"]])
            for name, m in sorted(maps["modules"].items())]


def load_maps(path: str | Path) -> dict:
    from dynquant.format.validate import load_metadata

    doc = load_metadata(str(path))
    if not isinstance(doc, dict) or doc.get("schema") != MAPS_SCHEMA:
        raise DynquantError(f"not a {MAPS_SCHEMA} document", file=str(path), field="schema")
    return doc


def _dense_model(source: ModelSource, dtype: str) -> nn.Module:
    from dynquant.pipeline.evaluate import load_any

    if source.directory is None:
        raise DynquantError("the kl method needs model weights (a model directory)",
                            file=source.name)
    return load_any(source.directory, dtype=dtype)


def measure(source: ModelSource, opts: MeasureOptions, out: str | Path | None = None,
            progress: bool = True, random_init: bool = False) -> dict:
    """Measure every quantizable module; returns (and writes to ``out``) the maps document."""
    from dynquant.pipeline.calibration import (
        calibration_ids,
        collect_stats,
        read_calibration,
        save_stats,
    )
    from dynquant.pipeline.generate import load_tokenizer
    from dynquant.pipeline.quantize import weight_source

    method = opts.method or ("kl" if opts.calib else "weight")
    if method == "kl" and not opts.calib:
        raise DynquantError("--method kl needs calibration text (--calib FILE)", field="method")
    read_calibration(list(opts.calib))  # fail on a missing or empty file before any work
    specs = source.tensor_specs()
    dense_out = set(excluded_modules(specs, opts.not_convert))
    quantizable = [s for s in specs if s.quantizable and s.module not in dense_out]
    stats: dict[str, torch.Tensor] = {}
    stats_path = None
    probe = None
    if opts.calib:
        model = _dense_model(source, opts.dtype)
        ids = calibration_ids(load_tokenizer(source.directory), list(opts.calib),
                              opts.calib_seqs, opts.calib_len)
        stats = collect_stats(model, ids, {s.module for s in quantizable})
        if out is not None:
            stats_path = Path(out).with_name(Path(out).stem + ".stats.safetensors")
            save_stats(stats, stats_path)
        probe = KLProbe(model, ids) if method == "kl" else None
    weights = weight_source(source, random_init)
    modules = {}
    try:
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("measuring", total=len(quantizable))
            for spec in quantizable:
                modules[spec.module] = _measure_module(spec, weights.get(spec), source, opts,
                                                       stats.get(spec.module), probe)
                bar.advance(task)
    finally:
        weights.close()
    doc = {"schema": MAPS_SCHEMA, "model": source.name, "method": method,
           "stats": None if stats_path is None else stats_path.name,  # beside maps.json
           "widths": list(opts.widths), "group_sizes": list(opts.group_sizes),
           "modules_to_not_convert": sorted(dense_out), "modules": modules}
    group_size = max(opts.group_sizes)
    doc["allocations"] = allocations(maps_modules(doc), opts.budgets, group_size)
    if out is not None:
        Path(out).write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return doc


def _measure_module(spec: TensorSpec, weight: torch.Tensor, source: ModelSource,
                    opts: MeasureOptions, importance: torch.Tensor | None,
                    probe: KLProbe | None) -> dict:
    cands = module_candidates(weight, opts.widths, opts.group_sizes, importance)
    if probe is not None:
        # KL of the module's own 3-bit weights over their (possibly importance-weighted)
        # error: predicted KL = sensitivity * error reproduces the probe exactly at 3 bits.
        gs = max(opts.group_sizes)
        bits = PROBE_BITS if PROBE_BITS in opts.widths else sorted(opts.widths)[0]
        qt = quantize_tensor(weight, bits, gs, importance=importance)
        probe_err = next(c.error for c in cands if (c.bits, c.group_size) == (bits, gs))
        sensitivity = probe.kl_with(spec.module, qt.dequantize(torch.float32)) / max(
            probe_err, 1e-12)
    else:
        sensitivity = weight_usage(spec, source) * squared_norm(weight)
    if not math.isfinite(sensitivity):
        raise DynquantError("non-finite sensitivity", module=spec.module, field="sensitivity")
    return {"logical_shape": list(spec.shape),
            "elements": LayerLayout.create(spec.shape, 8, 128).elements,
            "sensitivity": max(sensitivity, 0.0),
            "candidates": [{"bits": c.bits, "group_size": c.group_size, "nbytes": c.nbytes,
                            "error": c.error} for c in cands]}
