"""The seed-size model (1.69 B weights, random init) quantized with the seed's own widths
reproduces the seed document: every field but provenance, version strings and the clip statistics
(those within the core issue's tolerance of 0.01)."""

from __future__ import annotations

import json
import struct

from dynquant.cli import main

TOL = 0.01


def test_seed_random_init_reproduces_the_seed(tmp_path, seed_path, seed_doc):
    out = tmp_path / "seed"
    assert main(["quantize", "seed", "--random-init", "--widths", str(seed_path), "-o",
                 str(out), "--quiet"]) == 0
    doc = json.loads((out / "dynquant.json").read_text())
    for key in ("schema", "files", "accounting", "tied", "expert_banks"):
        assert doc[key] == seed_doc[key], key
    qc, sqc = dict(doc["quantization_config"]), dict(seed_doc["quantization_config"])
    assert {k: v for k, v in qc.items() if k != "version"} == {
        k: v for k, v in sqc.items() if k != "version"}
    assert list(doc["layers"]) == list(seed_doc["layers"])
    for name, want in seed_doc["layers"].items():
        got = doc["layers"][name]
        for field, value in want.items():
            if field in ("clipped_fraction", "clip_improvement"):
                assert abs(got[field] - value) <= TOL, (name, field, got[field], value)
            else:
                assert got[field] == value, (name, field)
    assert doc["provenance"]["predicted_nbytes"] == seed_doc["accounting"]["total_nbytes"]
    with open(out / "model.safetensors", "rb") as fh:  # 8-byte length, header, the tensors
        header = 8 + struct.unpack("<Q", fh.read(8))[0]
    assert doc["files"] == ["model.safetensors"]
    size = (out / "model.safetensors").stat().st_size
    assert size == header + seed_doc["accounting"]["total_nbytes"]
