"""Text generation from a checkpoint, streaming tokens as they come."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dynquant.checkpoint.reader import require_checkpoint
from dynquant.errors import ModelError
from dynquant.models.tokenizer import load_tokenizer
from dynquant.numerics.compute_dtype import describe, resolve_dtype
from dynquant.runtime.activations import describe_activations
from dynquant.runtime.loader import load
from dynquant.runtime.memory import resident_weight_nbytes


@dataclass
class GenerationStats:
    """What a generation cost: llama.cpp's tools print the same three."""

    prompt_tokens: int
    new_tokens: int
    prefill_s: float  # prompt in, first new token out
    decode_s: float  # the remaining new tokens
    weight_nbytes: int  # resident weights (packed codes, scales, dense parts)

    def line(self) -> str:
        prefill = self.prompt_tokens / max(self.prefill_s, 1e-9)
        decode = max(self.new_tokens - 1, 0) / max(self.decode_s, 1e-9)
        return (f"[prefill {self.prompt_tokens} tokens {prefill:.1f} tok/s; decode "
                f"{self.new_tokens} tokens {decode:.1f} tok/s; weights "
                f"{self.weight_nbytes / 2**20:.1f} MiB resident]")


class _Clock:
    """A streamer's view of time: when the prompt went in, the first new token, the last."""

    def __init__(self, inner=None) -> None:
        self.inner, self.calls, self.tokens = inner, 0, 0
        self.start = self.first = self.last = time.perf_counter()

    def put(self, value) -> None:
        self.calls += 1
        now = time.perf_counter()
        if self.calls == 2:  # the first put is the prompt
            self.first = now
        if self.calls >= 2:
            self.tokens += value.numel()
        self.last = now
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def generate_text(path: str | Path, prompt: str, max_new_tokens: int = 64,
                  temperature: float = 0.0, seed: int = 0, stream: bool = True,
                  dtype: str | torch.dtype | None = None, chat: bool = False,
                  stats: list[GenerationStats] | None = None,
                  activations: str | None = None) -> str:
    """The completion of ``prompt`` (greedy when temperature is 0), printed as it is generated,
    in the compute dtype ``dtype`` (None/"auto": the CPU's; said in one line when streaming),
    followed (on stderr) by prefill and decode speed and the resident weight memory.
    ``chat``: the prompt is one user turn through the model's chat template. ``stats``: gets
    the :class:`GenerationStats` appended. ``activations``: int8 or float decode products
    (``runtime/activations.py``)."""
    from transformers import TextStreamer


    if not prompt:
        raise ModelError("the prompt is empty", field="prompt")
    require_checkpoint(path)  # before the tokenizer: its error would name the wrong thing
    tokenizer = load_tokenizer(path)
    ids = _prompt_ids(tokenizer, prompt, chat, path)  # a missing template: before any loading
    dtype = resolve_dtype(dtype)
    model = load(path, dtype=dtype, activations=activations)
    if stream:  # on stderr: stdout is the text alone
        print(f"[{describe(dtype)}; {describe_activations(activations)}]",
              file=sys.stderr, flush=True)
    torch.manual_seed(seed)
    clock = _Clock(TextStreamer(tokenizer, skip_prompt=chat, skip_special_tokens=True)
                   if stream else None)
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(
        do_sample=False)
    with torch.no_grad():
        clock.start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, streamer=clock,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                             **sampling)
    cost = GenerationStats(ids.shape[1], clock.tokens, clock.first - clock.start,
                           clock.last - clock.first, resident_weight_nbytes(model))
    if stream:
        print(cost.line(), file=sys.stderr, flush=True)
    if stats is not None:
        stats.append(cost)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _prompt_ids(tokenizer, prompt: str, chat: bool, path: str | Path) -> torch.Tensor:
    if not chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("--chat: the tokenizer has no chat template (an instruct model's "
                         "tokenizer_config.json carries one)", file=str(path))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
