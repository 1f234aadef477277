"""The seed document is the specification by example: we read it, and we reproduce it exactly."""

from __future__ import annotations

import json

from dynquant.cli import main
from dynquant.format.jsonstyle import dumps
from dynquant.format.validate import validate_metadata

CLIP_STATS = ("clipped_fraction", "clip_improvement")


def test_json_style_reproduces_the_seed_bytes(seed_path, seed_doc):
    assert dumps(seed_doc) == seed_path.read_text()


def test_validate_accepts_the_seed(seed_path, seed_doc, capsys):
    assert validate_metadata(seed_doc) == []
    assert main(["validate", str(seed_path)]) == 0
    assert "valid" in capsys.readouterr().out


def test_inspect_summarises_the_seed(seed_path, capsys):
    assert main(["inspect", str(seed_path)]) == 0
    out = capsys.readouterr().out
    assert "moe.w2" in out and "self_attn.k_proj" in out and "embed_tokens" in out
    assert "3.245736" in out and "686,943,744" in out
    assert "expert banks: 72" in out and "lm_head -> model.embed_tokens" in out
    # moe.w2: 16 layers at 2 bits, 8 at 3 bits
    row = next(line for line in out.splitlines() if "moe.w2" in line)
    assert [c.strip() for c in row.split("│")[2:5]] == ["24", "16", "8"]


def test_inspect_json_is_the_metadata(seed_path, seed_doc, capsys):
    assert main(["inspect", str(seed_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == seed_doc


def test_plan_seed_reproduces_the_seed_exactly(seed_path, seed_doc, capsys):
    assert main(["plan", "seed", "--widths", str(seed_path), "--json"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out)
    assert list(plan) == list(seed_doc)  # same fields, same order
    for key in ("schema", "files", "accounting", "tied", "expert_banks"):
        assert plan[key] == seed_doc[key], key
    qc, seed_qc = dict(plan["quantization_config"]), dict(seed_doc["quantization_config"])
    qc.pop("version")
    seed_qc.pop("version")
    assert qc == seed_qc
    assert list(plan["layers"]) == list(seed_doc["layers"])
    for name, entry in seed_doc["layers"].items():
        mine = plan["layers"][name]
        assert list(mine) == list(entry)
        assert {k: v for k, v in mine.items() if k not in CLIP_STATS} == {
            k: v for k, v in entry.items() if k not in CLIP_STATS}, name
        assert mine["clipped_fraction"] is None and mine["clip_improvement"] is None
    assert plan["provenance"]["predicted_nbytes"] == seed_doc["accounting"]["total_nbytes"]
    assert plan["provenance"]["allocator"] == "manual"


def test_plan_with_a_widths_json(tmp_path, seed_doc, capsys):
    widths = {n: e["bits"] for n, e in seed_doc["quantization_config"]["modules"].items()}
    (tmp_path / "w.json").write_text(json.dumps(widths))
    assert main(["plan", "seed", "--widths", str(tmp_path / "w.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accounting"] == seed_doc["accounting"]


def test_plan_human_summary(seed_path, capsys):
    assert main(["plan", "seed", "--widths", str(seed_path)]) == 0
    assert "686,943,744" in capsys.readouterr().out
