"""``import dynquant`` is light; transformers learns about dynquant whenever it is imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_LIGHT = """
import sys
from dynquant.cli import main
assert main(["validate", sys.argv[1]]) == 0
assert main(["inspect", sys.argv[1]]) == 0
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("heavy:", heavy)
"""

_REGISTERS = """
import sys
order = sys.argv[2]
if order == "transformers first":
    import transformers  # noqa: F401
if order == "a dynquant module imports transformers":  # registering must wait for it to finish
    from dynquant.models.hybrid.configuration import DynquantHybridConfig  # noqa: F401
import dynquant  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM
assert AutoConfig.for_model("dynquant_hybrid").model_type == "dynquant_hybrid"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model).__name__, type(model.lm_head).__name__)
"""


def _start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-W", "error::RuntimeWarning:dynquant.autoregister",
                             "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _output(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "could not register" not in err
    return out


def _run(script: str, *args: str) -> str:
    return _output(_start(script, *args))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("tiny", 3)


def test_validate_and_inspect_import_neither_torch_nor_transformers(checkpoint):
    assert _run(_LIGHT, str(checkpoint)).splitlines()[-1] == "heavy: []"


def test_transformers_knows_dynquant_whichever_is_imported_first(checkpoint):
    orders = ("dynquant first", "transformers first", "a dynquant module imports transformers")
    runs = {order: _start(_REGISTERS, str(checkpoint), order) for order in orders}  # at once
    for order, proc in runs.items():
        assert _output(proc).splitlines()[-1] == "DynquantHybridForCausalLM TiedQuantHead", order


_SPIN = """
import os, sys
if sys.argv[1] == "torch first":
    import torch  # noqa: F401
import dynquant  # noqa: F401
print(os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize(("order", "env", "expect"), [
    ("dynquant first", {}, "1000 None"),  # the short spin, before libgomp loads
    ("torch first", {}, "None None"),  # too late to matter: left alone
    ("dynquant first", {"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),  # the user's choice
    ("dynquant first", {"GOMP_SPINCOUNT": "5"}, "5 None"),
])
def test_openmp_spins_briefly_unless_told_otherwise(order, env, expect):
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", _SPIN, order], env={**base, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == expect


def test_one_version_everywhere(tmp_path, capsys):
    """pyproject.toml's version is the package's, the CLI's and every checkpoint's."""
    import json
    import tomllib
    from importlib.metadata import version

    import dynquant
    from dynquant.cli import main

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    expected = declared["project"]["version"]
    assert dynquant.__version__ == version("dynquant") == expected
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"dynquant {expected}"
    assert main(["quantize", "tiny", "--random-init", "--uniform", "4", "-o",
                 str(tmp_path / "q"), "--quiet"]) == 0
    doc = json.loads((tmp_path / "q" / "dynquant.json").read_text())
    assert doc["provenance"]["dynquant_core"] == expected
