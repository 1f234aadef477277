"""Hostile and broken checkpoints: each is rejected with a typed error naming file/module/field."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dynquant import CheckpointError, open_checkpoint, validate_checkpoint, write_checkpoint
from dynquant.cli import main
from dynquant.format.jsonstyle import dumps

Q = "model.layers.0.mlp.down_proj"


@pytest.fixture()
def ckpt(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)
    write_checkpoint(tmp_path / "ck", {Q: (torch.randn(32, 172, generator=g), 4),
                                       "model.layers.0.moe.w1": (torch.randn(2, 8, 64), 3)},
                     {"model.norm.weight": torch.ones(32)})
    return tmp_path / "ck"


def _edit_meta(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(ck: Path) -> None:
        doc = json.loads((ck / "dynquant.json").read_text())
        fn(doc)
        (ck / "dynquant.json").write_text(dumps(doc))
    return apply


def _edit_tensors(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(ck: Path) -> None:
        tensors = load_file(ck / "model.safetensors")
        fn(tensors)
        save_file(tensors, ck / "model.safetensors")
    return apply


def _truncate(ck: Path) -> None:
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[:-100])


def _nan_scale(t: dict) -> None:
    t[f"{Q}.scales"][3, 1] = float("nan")


def _set(path: list, value) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return fn


CASES = {
    "missing tensor": (_edit_tensors(lambda t: t.pop(f"{Q}.offsets")), f"{Q}", "offsets"),
    "wrong shape": (_edit_tensors(lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"][:, :1].contiguous()})),
                    Q, "scales"),
    "wrong dtype": (_edit_tensors(lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].long()})),
                    Q, "qweight"),
    "NaN scale": (_edit_tensors(_nan_scale), Q, "NaN"),
    "nbytes disagrees": (_edit_meta(_set(["layers", Q, "nbytes"], 123)), Q, "nbytes"),
    "accounting disagrees": (_edit_meta(_set(["accounting", "packed_nbytes"], 1)), "accounting",
                             "packed_nbytes"),
    "dense bytes disagree": (_edit_meta(lambda d: (d["accounting"].update(
        dense_nbytes=d["accounting"]["dense_nbytes"] + 2, total_nbytes=d["accounting"][
            "total_nbytes"] + 2))), "dense_nbytes", "dense tensors hold"),
    "unknown schema": (_edit_meta(_set(["schema"], "dynquant_checkpoint_v9")), "schema",
                       "unknown schema"),
    "files escape (..)": (_edit_meta(_set(["files"], ["../x.safetensors"])), "files", "../x"),
    "files absolute": (_edit_meta(_set(["files"], ["/etc/x.safetensors"])), "files", "/etc"),
    "truncated safetensors": (_truncate, "model.safetensors", "truncated"),
    "absurd rows": (_edit_meta(_set(["layers", Q, "logical_shape"], [10**12, 172])), Q,
                    "logical_shape"),
    "negative group size": (_edit_meta(_set(["layers", Q, "group_size"], -128)), Q,
                            "group_size"),
    "unsupported bits": (_edit_meta(_set(["layers", Q, "bits"], 7)), Q, "bits"),
    "non-JSON metadata": (lambda ck: (ck / "dynquant.json").write_bytes(b"\x80PK\x03garbage"),
                          "dynquant.json", "not valid JSON"),
    "truncated metadata": (lambda ck: (ck / "dynquant.json").write_text(
        (ck / "dynquant.json").read_text()[:500]), "dynquant.json", "not valid JSON"),
    "missing metadata": (lambda ck: (ck / "dynquant.json").unlink(), "dynquant.json",
                         "no such file"),
    "modules disagree": (_edit_meta(_set(["quantization_config", "modules", Q, "bits"], 8)), Q,
                         "modules.bits"),
    "expert banks wrong": (_edit_meta(_set(["expert_banks"], [])), "expert_banks", "3-D"),
    "bad header length": (lambda ck: (ck / "model.safetensors").write_bytes(
        struct.pack("<Q", 10**15) + b"{}"), "model.safetensors", "header"),
    "config mismatch": (lambda ck: (ck / "config.json").write_text("{}"), "config.json",
                        "quantization_config"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_checkpoint_is_rejected(ckpt, case, capsys):
    breaker, *needles = CASES[case]
    breaker(ckpt)
    problems = validate_checkpoint(str(ckpt))
    assert problems, case
    assert all(isinstance(p, CheckpointError) for p in problems)
    text = "\n".join(str(p) for p in problems)
    for needle in needles:
        assert needle in text, (case, text)
    with pytest.raises(CheckpointError):
        open_checkpoint(ckpt)
    assert main(["validate", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert all(line.startswith("invalid: ") for line in err.strip().splitlines())


def test_absurd_sizes_fail_before_any_allocation(ckpt):
    # 10^12 rows would need terabytes; validation must answer from arithmetic alone.
    _edit_meta(_set(["layers", Q, "logical_shape"], [10**12, 10**6]))(ckpt)
    problems = validate_checkpoint(str(ckpt))
    assert any("2^40" in str(p) for p in problems)


def test_cli_prints_one_line_without_traceback(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["inspect", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynquant: error: ") and "bad.json" in err
    assert main(["plan", "no-such-model", "--widths", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err


def test_nothing_is_unpickled():
    src = Path(__file__).parents[1] / "src"
    for path in src.rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text, path
        if "torch.load(" in text:
            assert "weights_only=True" in text, path


def test_every_option_says_what_it_does():
    """Every subcommand's options and positionals carry a help line."""
    import argparse

    from dynquant.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in sub.choices.items()
               for a in p._actions if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []
    assert all(action.help for action in sub._choices_actions)  # one line per command


def test_readme_use_and_help_agree():
    """The README's "Use" block names the commands in --help's order, with options they have."""
    import argparse
    import shlex
    from pathlib import Path

    from dynquant.cli import build_parser

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    use = readme.split("## Use", 1)[1].split("```python", 1)[0]
    lines = [shlex.split(line.split("  #")[0]) for line in use.splitlines()
             if line.startswith("dynquant ")]
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    seen = list(dict.fromkeys(words[1] for words in lines))
    assert seen == [c for c in sub.choices if c != "demo"]  # demo: `make demo`, README Set-up
    for words in lines:
        options = {o for a in sub.choices[words[1]]._actions for o in a.option_strings}
        used = {w for w in words[2:] if w.startswith("-")}
        assert used <= options, (words, used - options)
    assert "make demo" in readme


def test_ray_without_ray_installed_is_one_line(tmp_path, capsys, monkeypatch):
    """--ray where the ray package is missing: one line naming the extra, exit 2, nothing
    written."""
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    out = tmp_path / "q"
    assert main(["quantize", "tiny", "--random-init", "--uniform", "4", "-o", str(out),
                 "--quiet", "--ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dynquant[ray]" in err, err
    assert not out.exists()
