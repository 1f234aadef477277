"""Text generation from a checkpoint, streaming tokens as they come."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

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


def generate_text(path: str | Path, prompt: str, max_new_tokens: int = 64,
                  temperature: float = 0.0, seed: int = 0, stream: bool = True,
                  dtype: str | torch.dtype | None = None) -> str:
    """The completion of ``prompt`` (greedy when temperature is 0), printed as it is generated,
    in the compute dtype ``dtype`` (None/"auto": the CPU's; said in one line when streaming)."""
    from transformers import TextStreamer

    from dynquant.numerics.compute_dtype import describe, resolve_dtype
    from dynquant.runtime.loader import load

    if not prompt:
        raise ModelError("the prompt is empty", field="prompt")
    tokenizer = load_tokenizer(path)
    dtype = resolve_dtype(dtype)
    model = load(path, dtype=dtype)
    if stream:  # on stderr: stdout is the text alone
        print(f"[{describe(dtype)}]", file=sys.stderr, flush=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(seed)
    streamer = TextStreamer(tokenizer, skip_prompt=False) if stream else None
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(
        do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, streamer=streamer,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                             **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
