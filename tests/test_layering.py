"""Lower layers never import higher ones (format <- numerics <- checkpoint <- models/runtime <-
pipeline <- CLI), the pipeline's rooms keep their own order, no module imports itself back
through others, none reaches into another's private names, and the validator needs no torch."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "dynquant"
RANK = {"errors": 0, "format": 1, "numerics": 2, "checkpoint": 3, "models": 4, "runtime": 4,
        "pipeline": 5, "api": 6, "cli": 6, "autoregister": 6, "openmp": 0,
        "blas_kernels": 0, "import_hooks": 0,
        "version": 0}  # openmp: read by runtime; blas_kernels: by numerics
# the pipeline's stages, each a sub-package (README "Layout"): a room imports only lower ones
ROOMS = {"execute": 0, "calibrate": 1, "codes": 2, "allocate": 3, "config": 4, "measure": 5,
         "report": 6, "workflow": 7}


def _name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """Every import in the file, deferred ones (inside functions) included."""
    return [node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom | ast.Import)]


def _modules(path: Path) -> set[str]:
    out = set()
    for node in _imports(path):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _ranked(module: str, ranks: dict[str, int], depth: int) -> str | None:
    parts = module.split(".")
    return parts[depth] if len(parts) > depth and parts[depth] in ranks else None


def _upward(ranks: dict[str, int], prefix: str, depth: int) -> list[str]:
    violations = []
    for path in SRC.rglob("*.py"):
        name = _name(path)
        if not name.startswith(prefix) or (mine := _ranked(name, ranks, depth)) is None:
            continue
        for mod in _modules(path):
            theirs = _ranked(mod, ranks, depth) if mod.startswith(prefix) else None
            if theirs is not None and ranks[theirs] > ranks[mine]:
                violations.append(f"{name} imports {mod}")
    return violations


def test_no_upward_imports():
    # models and runtime share a rank: each may use the other, never pipeline or CLI
    assert _upward(RANK, "dynquant.", 1) == []


def test_pipeline_rooms_import_only_lower_rooms():
    rooms = {p.stem if p.is_file() else p.name for p in (SRC / "pipeline").iterdir()
             if p.name != "__init__.py" and not p.name.startswith("__")}
    assert rooms == set(ROOMS)  # a new room gets its place in the order
    assert _upward(ROOMS, "dynquant.pipeline.", 2) == []


def _graph() -> dict[str, set[str]]:
    names = {_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in _imports(path):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif node.module:  # ``from pkg import module`` names a module too
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join([*stack[stack.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_module_imports_another_modules_private_names():
    leaks = []
    for path in SRC.rglob("*.py"):
        for node in _imports(path):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dynquant"):
                leaks += [f"{_name(path)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert leaks == []


def test_validator_and_header_reader_need_no_torch():
    for name in ("validate.py", "safetensors_header.py", "metadata.py", "layout.py",
                 "jsonstyle.py", "widths.py", "planner.py"):
        mods = _modules(SRC / "format" / name)
        assert not any(m.split(".")[0] in ("torch", "transformers") for m in mods), name


def test_the_cli_reaches_the_pipeline_only_through_the_api():
    """``cli.py`` maps arguments onto ``dynquant.api``: what the command line can do, the API
    can do (and nothing the CLI runs bypasses it)."""
    mods = _modules(SRC / "cli.py")
    assert "dynquant.api" in mods or any(
        isinstance(n, ast.ImportFrom) and n.module == "dynquant" and
        any(a.name == "api" for a in n.names) for n in _imports(SRC / "cli.py"))
    assert sorted(m for m in mods if m.startswith("dynquant.pipeline")) == []
