"""``dynquant.api``, the one way into the pipeline: the CLI's commands are calls of it, so the
same options give the same bytes either way."""

from __future__ import annotations

import json

import pytest

from dynquant import api
from dynquant.cli import main
from dynquant.errors import DynquantError
from shipped_models import LLAMA_REF, checkpoint_bytes


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    """llama-ref quantized by the CLI at a budget on the bundled text: measured, allocated,
    tuned codes, then end-to-end scales (few windows and steps)."""
    out = tmp_path_factory.mktemp("cli") / "q"
    assert main(["quantize", str(LLAMA_REF), "--budget", "3.5", "--calib-seqs", "2",
                 "--gptq-seqs", "4", "--calib-len", "64", "--tune-steps", "4", "--e2e-steps",
                 "3", "--pin", "model.embed_tokens=4", "-o", str(out), "--quiet"]) == 0
    return out


def test_the_cli_and_the_api_write_the_same_bytes(cli_checkpoint, tmp_path):
    doc = api.quantize(LLAMA_REF, tmp_path / "q", budget=3.5, calib_seqs=2, gptq_seqs=4,
                       calib_len=64, tuning=api.ScaleTuning(steps=4),
                       end_to_end=api.EndToEndTuning(steps=3), pins=["model.embed_tokens=4"],
                       progress=False)
    assert doc["provenance"]["quantizer"] == "tuned"
    assert doc["quantization_config"]["modules"]["model.embed_tokens"]["bits"] == 4
    assert checkpoint_bytes(tmp_path / "q") == checkpoint_bytes(cli_checkpoint)


def test_allocate_through_the_api_is_the_cli_s(cli_checkpoint, tmp_path, capsys):
    maps = cli_checkpoint / "maps.json"  # shipped inside the checkpoint
    assert main(["allocate", str(maps), "--budget", "3.0", "--max-bits", "4", "-o",
                 str(tmp_path / "w.json")]) == 0
    alloc = api.allocate(maps, 3.0, max_bits=4)
    assert json.loads((tmp_path / "w.json").read_text()) == api.widths_json(alloc, maps)
    assert max(bits for bits, _ in alloc.widths.values()) <= 4
    assert alloc.average_bits <= 3.0
    with pytest.raises(DynquantError, match="budget"):
        api.allocate(maps)
    assert main(["allocate", str(maps)]) == 2
    assert "budget" in capsys.readouterr().err


def test_the_api_takes_only_its_configurations_fields(tmp_path):
    with pytest.raises(TypeError, match="budjet"):
        api.quantize("tiny", tmp_path / "q", budjet=4.25)
    with pytest.raises(TypeError, match="calib_sequences"):
        api.measure("tiny", calib_sequences=4)


def test_flat_option_names_build_the_sectioned_configurations():
    """A field by its flat name lands in its section (the calibration's by the CLI's names), a
    whole section can be given and then refined, and a name no section has is refused."""
    from dynquant.api import (
        AllocationOptions,
        Calibration,
        CodeOptions,
        MeasureOptions,
        QuantizeRequest,
        RunOptions,
    )

    flat = QuantizeRequest.of("o", budget=4.25, calib_seqs=16, quantizer="gptq",
                              executor="ray", not_convert=["lm_head"], seed=3)
    assert flat == QuantizeRequest(
        "o", measure=MeasureOptions(calibration=Calibration(seqs=16), not_convert=["lm_head"]),
        allocation=AllocationOptions(budget=4.25), codes=CodeOptions(quantizer="gptq"),
        run=RunOptions(executor="ray"), seed=3)
    refined = QuantizeRequest.of("o", codes=CodeOptions(gptq_seqs=8), quantizer="tuned")
    assert refined.codes == CodeOptions(quantizer="tuned", gptq_seqs=8)
    assert MeasureOptions.of(calib=["a.txt"], calib_len=64) == MeasureOptions(
        calibration=Calibration(texts=["a.txt"], length=64))
    with pytest.raises(TypeError, match="unknown option 'bugdet'"):
        QuantizeRequest.of("o", bugdet=4.25)
