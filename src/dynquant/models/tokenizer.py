"""A model folder's tokenizer: whatever transformers' AutoTokenizer reads there."""

from __future__ import annotations

from pathlib import Path

from dynquant.errors import ModelError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    if not has_tokenizer(path):
        raise ModelError("no tokenizer in the checkpoint (it copies tokenizer.json and friends "
                         "from the source model directory)", file=str(path))
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(f"no usable tokenizer in the checkpoint ({exc})", file=str(path)) from exc
