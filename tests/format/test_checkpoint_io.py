"""Quantize -> write -> read: bit-exact round trips, reproducible bytes, atomic writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from dynquant import open_checkpoint, quantize_tensor, validate_checkpoint, write_checkpoint
from dynquant.checkpoint import writer as writer_mod
from dynquant.format.jsonstyle import dumps


def small_model(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    modules = {
        "model.embed_tokens": (torch.randn(300, 64, generator=g), 4),
        "model.layers.0.self_attn.q_proj": (torch.randn(64, 64, generator=g), 8),
        "model.layers.0.mlp.down_proj": (torch.randn(64, 172, generator=g), 3),
        "model.layers.0.moe.w1": (torch.randn(4, 64, 96, generator=g), 2),
    }
    dense = {
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "model.layers.0.conv.conv.weight": torch.randn(64, 1, 3, generator=g),
        "model.norm.weight": torch.ones(64, dtype=torch.float32),
        "model.layers.0.moe.gate.weight": torch.randn(4, 64, generator=g).half(),
    }
    return modules, dense


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_round_trip_is_bit_exact_and_validates(tmp_path):
    modules, dense = small_model()
    doc = write_checkpoint(tmp_path / "ck", modules, dense, tied={"lm_head": "model.embed_tokens"})
    assert validate_checkpoint(str(tmp_path / "ck")) == []
    ck = open_checkpoint(tmp_path / "ck")
    for name, (w, bits) in modules.items():
        expected = quantize_tensor(w, bits).dequantize()
        got = ck.dequantize(name)
        assert got.shape == w.shape and got.dtype == torch.bfloat16
        assert torch.equal(got, expected)
    assert ck.dense_names() == sorted(dense)
    assert ck.tensor("model.norm.weight").dtype == torch.bfloat16  # fp32 stored as bf16
    assert ck.tensor("model.layers.0.moe.gate.weight").dtype == torch.float16  # kept narrow
    assert doc["expert_banks"] == ["model.layers.0.moe.w1"]
    on_disk = (tmp_path / "ck" / "dynquant.json").read_text()
    assert on_disk == dumps(doc)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["quantization_config"] == doc["quantization_config"]


def test_accounting_matches_file_sizes(tmp_path):
    modules, dense = small_model()
    doc = write_checkpoint(tmp_path / "ck", modules, dense)
    acc = doc["accounting"]
    size = (tmp_path / "ck" / "model.safetensors").stat().st_size
    header = int.from_bytes((tmp_path / "ck" / "model.safetensors").read_bytes()[:8], "little")
    assert size - 8 - header == acc["total_nbytes"]  # data bytes = exact accounting
    assert acc["average_bits"] == round(acc["packed_nbytes"] * 8 / acc["quantized_elements"], 6)


def test_same_input_gives_byte_identical_files(tmp_path):
    modules, dense = small_model()
    write_checkpoint(tmp_path / "a", modules, dense)
    write_checkpoint(tmp_path / "b", *small_model())
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")


def test_sharded_checkpoint(tmp_path):
    modules, dense = small_model()
    doc = write_checkpoint(tmp_path / "ck", modules, dense, max_shard_bytes=20_000)
    assert len(doc["files"]) > 1
    assert all((tmp_path / "ck" / f).is_file() for f in doc["files"])
    assert validate_checkpoint(str(tmp_path / "ck")) == []
    ck = open_checkpoint(tmp_path / "ck")
    w, bits = modules["model.layers.0.mlp.down_proj"]
    assert torch.equal(ck.dequantize("model.layers.0.mlp.down_proj"),
                       quantize_tensor(w, bits).dequantize())


def test_crash_while_writing_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(writer_mod, "write_safetensors", boom)
    modules, dense = small_model()
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_checkpoint(tmp_path / "ck", modules, dense)
    assert list(tmp_path.iterdir()) == []  # no output, no temp dir left behind


def test_existing_output_needs_overwrite(tmp_path):
    modules, dense = small_model()
    write_checkpoint(tmp_path / "ck", modules, dense)
    before = _digests(tmp_path / "ck")
    with pytest.raises(Exception, match="exists"):
        write_checkpoint(tmp_path / "ck", *small_model(1))
    assert _digests(tmp_path / "ck") == before
    write_checkpoint(tmp_path / "ck", *small_model(1), overwrite=True)
    assert _digests(tmp_path / "ck") != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_opening_a_checkpoint_reads_each_header_once(tiny_checkpoint, monkeypatch):
    """Validation and the reader share one parse of the metadata and of every header."""
    from dynquant.checkpoint.reader import open_checkpoint
    from dynquant.format import validate as validate_mod
    from dynquant.runtime import loader  # noqa: F401  (the reader's users import it first)

    checkpoint = tiny_checkpoint("tiny", 4)
    calls = []
    real = validate_mod.read_header
    from dynquant.checkpoint import reader as reader_mod

    for mod in (validate_mod, reader_mod):
        monkeypatch.setattr(mod, "read_header", lambda p: calls.append(p) or real(p))
    ckpt = open_checkpoint(checkpoint)
    assert len(calls) == len(ckpt.metadata["files"])
    assert ckpt.tensor_names() and ckpt.dequantize(next(iter(ckpt.layers))).ndim == 2
