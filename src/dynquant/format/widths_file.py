"""Reading a widths source: a dynquant.json (its quantization_config.modules) or a widths JSON.

A widths JSON maps module -> bits, or module -> {"bits": b, "group_size": g}.
"""

from __future__ import annotations

from dynquant.errors import ModelError
from dynquant.format.planner import WidthChoice
from dynquant.format.validate import load_metadata


def _choice(path: str, name: str, value: object, default_gs: int | None) -> WidthChoice:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, dict) and isinstance(value.get("bits"), int):
        gs = value.get("group_size", default_gs)
        return (value["bits"], gs) if isinstance(gs, int) else value["bits"]
    raise ModelError(f"width must be an integer or {{'bits': ...}}, got {value!r}",
                     file=path, module=name, field="bits")


def load_widths(path: str) -> dict[str, WidthChoice]:
    """The module -> width map of a widths source file."""
    doc = load_metadata(path)
    if not isinstance(doc, dict):
        raise ModelError("widths file must hold a JSON object", file=path)
    default_gs = None
    if "quantization_config" in doc:
        qc = doc["quantization_config"]
        modules = qc.get("modules") if isinstance(qc, dict) else None
        if not isinstance(modules, dict):
            raise ModelError("quantization_config.modules missing", file=path, field="modules")
        default_gs = qc.get("group_size")
    else:
        modules = doc.get("widths", doc)
    return {name: _choice(path, name, v, default_gs) for name, v in modules.items()}
