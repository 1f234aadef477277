"""A readable summary of a dynquant.json document: module types x widths, sizes, clip statistics."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

_LAYER_PREFIX = re.compile(r"^(model\.)?(layers\.\d+\.)?")


def module_type(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``self_attn.q_proj``; ``model.embed_tokens`` ->
    ``embed_tokens``."""
    return _LAYER_PREFIX.sub("", name) or name


@dataclass
class TypeRow:
    """Totals of one module type."""

    modules: int = 0
    elements: int = 0
    nbytes: int = 0
    by_bits: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    clip_cf: list[float] = field(default_factory=list)
    clip_ci: list[float] = field(default_factory=list)

    @property
    def average_bits(self) -> float:
        return self.nbytes * 8 / self.elements if self.elements else 0.0


def type_rows(doc: dict) -> dict[str, TypeRow]:
    rows: dict[str, TypeRow] = defaultdict(TypeRow)
    for name, e in doc["layers"].items():
        row = rows[module_type(name)]
        n = 1
        for d in e["logical_shape"]:
            n *= d
        row.modules += 1
        row.elements += n
        row.nbytes += e["nbytes"]
        row.by_bits[e["bits"]] += 1
        if e.get("clipped_fraction") is not None and e["bits"] < 8:
            row.clip_cf.append(e["clipped_fraction"])
            row.clip_ci.append(e["clip_improvement"])
    return dict(sorted(rows.items()))


def _mean(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.3f}" if xs else "-"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def console():
    """A rich console; 120 columns when the output is not a terminal (logs, pipes)."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)


def render_summary(doc: dict, title: str) -> None:
    """Print the summary with rich."""
    from rich.table import Table

    rows = type_rows(doc)
    widths = sorted({b for r in rows.values() for b in r.by_bits})
    table = Table(title=title, title_justify="left")
    table.add_column("module type", no_wrap=True)
    table.add_column("n", justify="right")
    for b in widths:
        table.add_column(f"{b}-bit", justify="right")
    for col in ("weights", "MiB", "avg bits", "clipped", "clip gain"):
        table.add_column(col, justify="right")
    for t, r in rows.items():
        table.add_row(t, str(r.modules), *[str(r.by_bits.get(b, "")) for b in widths],
                      f"{r.elements / 1e6:,.2f}M", _mib(r.nbytes), f"{r.average_bits:.3f}",
                      _mean(r.clip_cf), _mean(r.clip_ci))
    out = console()
    out.print(table)
    acc, prov = doc["accounting"], doc.get("provenance") or {}
    out.print(
        f"packed {acc['packed_nbytes']:,} B + dense {acc['dense_nbytes']:,} B = "
        f"total {acc['total_nbytes']:,} B ({_mib(acc['total_nbytes'])} MiB); "
        f"{acc['quantized_elements']:,} quantized weights at {acc['average_bits']} bits"
    )
    banks = len(doc.get("expert_banks", []))
    tied = ", ".join(f"{k} -> {v}" for k, v in doc.get("tied", {}).items()) or "none"
    out.print(f"expert banks: {banks}; tied: {tied}; files: {', '.join(doc['files'])}")
    out.print("provenance: " + "; ".join(f"{k}={v}" for k, v in prov.items()))


def render_element_counts(specs: list, quantized: set[str]) -> None:
    """Quantized and dense elements per module type, so that no weight is skipped silently."""
    import math

    from rich.table import Table

    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for spec in specs:
        kind = module_type(spec.module)
        n = math.prod(spec.shape)
        rows[kind][0 if spec.module in quantized else 1] += n
        rows[kind][2] += 1
    table = Table(title="elements by tensor type", title_justify="left")
    for col in ("tensor type", "tensors", "quantized", "dense"):
        table.add_column(col, justify="left" if col == "tensor type" else "right", no_wrap=True)
    for kind, (q, d, count) in sorted(rows.items()):
        table.add_row(kind, str(count), f"{q:,}", f"{d:,}")
    q_total = sum(r[0] for r in rows.values())
    d_total = sum(r[1] for r in rows.values())
    table.add_row("total", str(len(specs)), f"{q_total:,}", f"{d_total:,}")
    console().print(table)
