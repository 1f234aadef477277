"""Calibration text: the files (or the English text dynquant ships) a model is calibrated on, their
record in maps.json and provenance, and the token windows they become; random tokens for the
data-free path."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import torch

from dynquant.errors import ModelError
from dynquant.models.sources import ModelSource
from dynquant.models.tokenizer import has_tokenizer


def read_calibration(files: list[str | Path]) -> list[str]:
    """The texts of the calibration files; a missing or empty file is an error."""
    texts = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ModelError("no such calibration file", file=str(path))
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ModelError("the calibration file is empty", file=str(path))
        texts.append(text)
    return texts


DEFAULT_TEXT = "calibration_default.txt"  # in the package's data folder (data/README.md)
BUNDLED_TEXT = f"dynquant:{DEFAULT_TEXT}"  # its name in calibration records


def default_calibration() -> Path:
    """The generic English text dynquant ships for calibration without ``--calib``."""
    return Path(str(resources.files("dynquant.data").joinpath(DEFAULT_TEXT)))


def calibration_record(files: list[str | Path], seqs: int, length: int) -> dict:
    """What a measurement calibrated on, for maps.json and the checkpoint's provenance: the
    texts (by file name; the bundled one as ``dynquant:calibration_default.txt``), the SHA-256
    of their joined text, and the token windows taken from it."""
    bundled = default_calibration()
    names = [BUNDLED_TEXT if Path(f) == bundled else Path(f).name for f in files]
    digest = hashlib.sha256("\n\n".join(read_calibration(files)).encode()).hexdigest()
    return {"texts": names, "sha256": digest, "sequences": seqs, "tokens_per_sequence": length}


SYNTHETIC_SEED = 0


def synthetic_ids(vocab_size: int, seqs: int, length: int) -> torch.Tensor:
    """Uniform random token ids [seqs, length], seeded: the data-free path's input. No text,
    yet the model's own structure (which channels its norms and outlier features drive) shows
    in the per-column statistics it gives the quantizer."""
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    return torch.randint(0, vocab_size, (seqs, length), generator=gen)


def synthetic_record(seqs: int, length: int) -> dict:
    return {"synthetic": f"uniform random token ids, seed {SYNTHETIC_SEED}", "sequences": seqs,
            "tokens_per_sequence": length}


def calibration_tokens(tokenizer, files: list[str | Path]) -> torch.Tensor:
    """The token ids of the calibration texts joined by blank lines."""
    return torch.tensor(tokenizer("\n\n".join(read_calibration(files)))["input_ids"],
                        dtype=torch.long)


def spread_windows(ids: torch.Tensor, seqs: int, length: int) -> torch.Tensor:
    """Up to ``seqs`` windows of ``length`` tokens evenly spread over ``ids`` (at least
    ``length`` of them): [windows, length]."""
    starts = torch.linspace(0, len(ids) - length, seqs).long().unique()
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


def calibration_ids(tokenizer, files: list[str | Path], seqs: int, length: int) -> torch.Tensor:
    """``seqs`` windows of ``length`` tokens, evenly spread over the text: [seqs, length]."""
    ids = calibration_tokens(tokenizer, files)
    if len(ids) < length:
        raise ModelError(f"calibration text has {len(ids)} tokens, fewer than one sequence of "
                         f"{length}", file=str(files[0]))
    return spread_windows(ids, seqs, length)


def calibration_blocker(source: ModelSource, random_init: bool) -> str | None:
    """What the model lacks to run calibration text through it (None: nothing)."""
    if random_init or source.directory is None:
        return "model weights (a model directory)"
    if not has_tokenizer(source.directory):
        return "a tokenizer in the model directory"
    return None
