"""The size/quality frontier (demo, benchmarks) allocates for the codes it writes."""

from __future__ import annotations

import json

from dynquant.cli import main
from dynquant.pipeline.allocate.allocation import allocate_widths
from dynquant.pipeline.allocate.maps import maps_codes, maps_modules
from dynquant.pipeline.report.frontier import size_quality_frontier
from model_zoo import TOKENIZER_TEXT, save_tiny_model, save_tiny_tokenizer

SHORT = ["--calib-seqs", "2", "--calib-len", "32", "--no-forecast-check"]


def test_frontier_prices_widths_for_the_round_to_nearest_codes_it_writes(tmp_path):
    """A calibrated maps document prices widths for compensated codes by default; the
    frontier writes round-to-nearest codes, so it allocates with the rtn prices. The Linears'
    gptq ratios are made tiny here, so that the two pricings choose different widths."""
    model = save_tiny_model("llama", tmp_path / "src")
    save_tiny_tokenizer(model)
    maps_path = tmp_path / "maps" / "maps.json"
    maps_path.parent.mkdir()
    assert main(["measure", str(model), "-o", str(maps_path), "--quiet", *SHORT]) == 0
    doc = json.loads(maps_path.read_text())
    for entry in doc["modules"].values():
        if "gptq_ratio" in entry:
            entry["gptq_ratio"] = 0.01
    maps_path.write_text(json.dumps(doc))
    assert maps_codes(doc) == "tuned"
    budget = 3.25
    rtn = allocate_widths(maps_modules(doc, "rtn"), budget)
    compensated = allocate_widths(maps_modules(doc), budget)
    assert rtn.widths != compensated.widths
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(TOKENIZER_TEXT * 3)
    (point,) = size_quality_frontier(model, None, heldout, tmp_path / "out", budgets=[budget],
                                     max_tokens=256, ctx=64, maps_path=maps_path,
                                     uniform=False)
    assert point.predicted_kl == rtn.predicted_error
    written = json.loads((point.checkpoint / "dynquant.json").read_text())
    assert written["accounting"]["packed_nbytes"] == rtn.packed_nbytes
    assert {m: (w["bits"], w["group_size"]) for m, w in written["layers"].items()} == rtn.widths
