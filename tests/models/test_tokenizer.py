"""A model folder's tokenizer, whichever kind it ships: tokenizer.json, or only a SentencePiece
``tokenizer.model`` (older Llama and Mistral folders, llama2.c exports)."""

from __future__ import annotations

import io

import pytest
import sentencepiece as spm

from dynquant.errors import ModelError
from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import has_tokenizer, load_tokenizer
from dynquant.pipeline.calibrate.text import calibration_blocker, calibration_ids
from model_zoo import TOKENIZER_TEXT, save_tiny_model


def _sentencepiece_model(vocab_size: int) -> bytes:
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT.split(". ")), model_writer=out,
        vocab_size=vocab_size, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2)
    return out.getvalue()


def test_a_folder_with_only_a_sentencepiece_model_calibrates(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    model = _sentencepiece_model(vocab_size=120)
    (folder / "tokenizer.model").write_bytes(model)
    assert has_tokenizer(folder)
    assert calibration_blocker(resolve_model(str(folder)), random_init=False) is None

    tok = load_tokenizer(folder)
    reference = spm.SentencePieceProcessor(model_proto=model)
    text = "the fox met a rabbit by the river"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == reference.encode(text)  # the same pieces as SentencePiece itself
    assert tok.decode(ids) == text

    (tmp_path / "calib.txt").write_text(TOKENIZER_TEXT)
    windows = calibration_ids(tok, [tmp_path / "calib.txt"], seqs=3, length=16)
    assert windows.shape == (3, 16)
    assert int(windows.max()) < 120


def test_a_folder_without_a_tokenizer_is_a_typed_error(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    assert not has_tokenizer(folder)
    assert calibration_blocker(resolve_model(str(folder)), random_init=False) == (
        "a tokenizer in the model directory")
    with pytest.raises(ModelError, match="no tokenizer"):
        load_tokenizer(folder)
