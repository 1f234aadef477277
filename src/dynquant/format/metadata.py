"""The dynquant.json document (schema ``dynquant_checkpoint_v2``): building it and its constants.

The field order, key order (sorted module names) and JSON style follow the seed document exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dynquant.format.widths import DEFAULT_GROUP_SIZE
from dynquant.version import package_version

SCHEMA = "dynquant_checkpoint_v2"
SCHEMA_VERSION = 1
QUANT_METHOD = "dynquant"
CHECKPOINT_FORMAT = "dynquant-packed"
METADATA_FILE = "dynquant.json"
CONFIG_FILE = "config.json"
DEFAULT_FILES = ("model.safetensors",)
ALLOCATORS = ("sensitivity", "uniform", "manual")


def core_version() -> str:
    return package_version()


@dataclass
class Provenance:
    """Where a checkpoint came from and how its widths were chosen."""

    model: str
    allocator: str = "manual"
    widths_from: str | None = None
    stats: str | None = None
    predicted_nbytes: int | None = None
    # what the sensitivities were calibrated on (maps.json's ``calibration``); None: data-free
    calibration: dict | None = None
    quantizer: str | None = None  # how codes were chosen when not round-to-nearest ("gptq")
    # GPTAQ's fraction where the codes were fitted to the float model's outputs
    float_targets: float | None = None

    def to_dict(self) -> dict:
        doc = {
            "dynquant_core": core_version(),
            "model": self.model,
            "stats": self.stats,
            "allocator": self.allocator,
            "widths_from": self.widths_from,
            "predicted_nbytes": self.predicted_nbytes,
        }
        if self.calibration is not None:  # data-free checkpoints keep the seed's exact keys
            doc["calibration"] = self.calibration
        if self.quantizer is not None:
            doc["quantizer"] = self.quantizer
        if self.float_targets is not None:
            doc["float_targets"] = self.float_targets
        return doc


@dataclass
class QuantizationOptions:
    """The global options recorded in ``quantization_config``."""

    group_size: int = DEFAULT_GROUP_SIZE
    lm_head_quantized: bool = False
    modules_to_not_convert: list[str] = field(default_factory=list)


def quantization_config(layers: Mapping[str, dict], options: QuantizationOptions) -> dict:
    """The ``quantization_config`` block (also written into config.json)."""
    modules = {}
    for name in sorted(layers):
        entry = {"bits": layers[name]["bits"], "out_features": layers[name]["num_rows"]}
        if layers[name]["group_size"] != options.group_size:
            entry["group_size"] = layers[name]["group_size"]
        modules[name] = entry
    return {
        "quant_method": QUANT_METHOD,
        "checkpoint_format": CHECKPOINT_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "version": core_version(),
        "group_size": options.group_size,
        "symmetric": False,
        "lm_head_quantized": options.lm_head_quantized,
        "modules_to_not_convert": sorted(options.modules_to_not_convert),
        "modules": modules,
    }


def accounting(layers: Mapping[str, dict], dense_nbytes: int) -> dict:
    """Exact byte accounting: packed modules, dense tensors, and the average bits per weight."""
    packed = sum(entry["nbytes"] for entry in layers.values())
    elements = 0
    for entry in layers.values():
        n = 1
        for d in entry["logical_shape"]:
            n *= d
        elements += n
    return {
        "packed_nbytes": packed,
        "dense_nbytes": dense_nbytes,
        "total_nbytes": packed + dense_nbytes,
        "quantized_elements": elements,
        "average_bits": round(packed * 8 / elements, 6) if elements else 0.0,
    }


def build_document(
    layers: Mapping[str, dict],
    *,
    dense_nbytes: int,
    options: QuantizationOptions,
    provenance: Provenance,
    tied: Mapping[str, str] | None = None,
    files: list[str] | None = None,
) -> dict:
    """The whole dynquant.json document, keys in the seed's order."""
    ordered = {name: layers[name] for name in sorted(layers)}
    return {
        "schema": SCHEMA,
        "dynquant_core": core_version(),
        "quantization_config": quantization_config(ordered, options),
        "files": list(files or DEFAULT_FILES),
        "accounting": accounting(ordered, dense_nbytes),
        "tied": dict(tied or {}),
        "expert_banks": [n for n in ordered if len(ordered[n]["logical_shape"]) == 3],
        "provenance": provenance.to_dict(),
        "layers": ordered,
    }
