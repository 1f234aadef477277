"""Lower layers never import higher ones (format <- numerics <- checkpoint <- models/runtime <-
pipeline <- CLI), and the validator needs no torch at all."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "dynquant"
RANK = {"errors": 0, "format": 1, "numerics": 2, "checkpoint": 3, "models": 4, "runtime": 4,
        "pipeline": 5, "api": 6, "cli": 6, "autoregister": 6, "openmp": 0}  # openmp: read by runtime


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_upward_imports():
    violations = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        layer = rel.parts[1] if len(rel.parts) > 1 else "__init__"
        layer = layer.removesuffix(".py")
        if layer not in RANK:
            continue
        for mod in _imports(path):
            # models and runtime share a rank: each may use the other, never pipeline or CLI
            if (mod.startswith("dynquant.") and _layer(mod) in RANK
                    and RANK[_layer(mod)] > RANK[layer]):
                violations.append(f"{rel} imports {mod}")
    assert violations == []


def test_validator_and_header_reader_need_no_torch():
    for name in ("validate.py", "safetensors_header.py", "metadata.py", "layout.py",
                 "jsonstyle.py", "widths.py", "planner.py"):
        mods = _imports(SRC / "format" / name)
        assert not any(m.split(".")[0] in ("torch", "transformers") for m in mods), name
