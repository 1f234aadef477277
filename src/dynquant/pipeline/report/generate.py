"""Text generation from a checkpoint, streaming tokens as they come.

``dynquant generate`` decodes with a loop of its own (:func:`decode_tokens`): one forward a
token continuing the model's cache, the token picked from its logits (greedy, or sampled at a
temperature with the model's top-k / top-p), stopping at an end-of-text token. transformers'
``generate`` pays a few milliseconds a token around each forward for features this command does
not offer (logits processors, stopping criteria, batches), as much as a small model's native
decode step (BENCHMARKS.md "Against llama.cpp"); a model loaded with ``dynquant.load`` keeps
``generate`` with all of them.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections.abc import Callable, Collection, Iterator
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
    """A streamer's view of time: when the prompt went in (its put first), the first new token,
    the last."""

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
    clock = _Clock(TextStreamer(tokenizer, skip_prompt=chat, skip_special_tokens=True)
                   if stream else None)
    pick = Sampler(temperature, model.generation_config, seed) if temperature > 0 else greedy
    eos = _eos_ids(model, tokenizer)
    clock.start = time.perf_counter()
    clock.put(ids)
    new = decode_tokens(model, ids, max_new_tokens, pick,
                        on_token=lambda t: clock.put(torch.tensor([t])), stop=eos)
    clock.end()
    cost = GenerationStats(ids.shape[1], clock.tokens, clock.first - clock.start,
                           clock.last - clock.first, resident_weight_nbytes(model))
    if stream:
        print(cost.line(), file=sys.stderr, flush=True)
    if stats is not None:
        stats.append(cost)
    return tokenizer.decode(new, skip_special_tokens=True)


def greedy(logits: torch.Tensor) -> int:
    """The most likely token (the lowest index among ties, as ``argmax``)."""
    return int(logits.argmax())


class Sampler:
    """A token drawn from ``softmax(logits / temperature)``, kept to the ``top_k`` most likely
    and the smallest set holding ``top_p`` of the probability where the model's generation
    config sets them (transformers' order: temperature, top-k, top-p), from a seeded
    generator."""

    def __init__(self, temperature: float, config=None, seed: int = 0) -> None:
        self.temperature = temperature
        self.top_k = getattr(config, "top_k", None)
        self.top_p = getattr(config, "top_p", None)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        scores = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            beyond = ordered.softmax(-1).cumsum(-1) > self.top_p
            beyond[1:] = beyond[:-1].clone()  # keep the token that crosses top_p
            beyond[0] = False
            scores = scores.masked_fill(torch.zeros_like(beyond).scatter(0, order, beyond),
                                        float("-inf"))
        return int(torch.multinomial(scores.softmax(-1), 1, generator=self.generator))


def prefill(model, ids: torch.Tensor):
    """The prompt's forward ``ids`` [1, n], filling the model's cache; logits at its last
    position only, where the model can skip the others (a prompt needs no more), and then the
    last decoder layer's feed-forward on that position alone (:func:`last_position_mlp`): what
    llama.cpp's prefill computes."""
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return model(input_ids=ids, use_cache=True)
    with last_position_mlp(model):
        return model(input_ids=ids, use_cache=True, logits_to_keep=1)


@contextlib.contextmanager
def last_position_mlp(model) -> Iterator[None]:
    """While inside, the last decoder layer's ``mlp`` sees the last position only: when only
    the last position's logits are kept, the other positions' outputs of that layer feed
    nothing (the cache holds keys and values, made before it). The layer's residual sum then
    broadcasts that one row over the positions, whose values before the last are not used. A
    model whose last layer has no ``mlp`` runs as it is."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    mlp = getattr(layers[-1], "mlp", None) if layers else None
    if not isinstance(mlp, torch.nn.Module):
        yield
        return
    handle = mlp.register_forward_pre_hook(_last_row)
    try:
        yield
    finally:
        handle.remove()


def _last_row(_module, inputs: tuple) -> tuple:
    hidden, *rest = inputs
    return (hidden[:, -1:], *rest)


def decode_tokens(model, ids: torch.Tensor, max_new_tokens: int,
                  pick: Callable[[torch.Tensor], int] = greedy,
                  on_token: Callable[[int], object] | None = None,
                  stop: Collection[int] = ()) -> list[int]:
    """Up to ``max_new_tokens`` tokens after ``ids`` [1, n]: the prompt's forward, then one
    forward a token continuing the cache the model made (a native decode step where the model
    takes them); ``pick`` chooses each token from its logits, ``on_token`` hears it as it comes;
    a token in ``stop`` ends the run (kept, as ``generate`` keeps it)."""
    new: list[int] = []
    with torch.no_grad():
        out = prefill(model, ids)
        while len(new) < max_new_tokens:
            token = pick(out.logits[0, -1])
            new.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop or len(new) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return new


def _eos_ids(model, tokenizer) -> set[int]:
    """The end-of-text tokens: the model's generation config's, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _prompt_ids(tokenizer, prompt: str, chat: bool, path: str | Path) -> torch.Tensor:
    if not chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("--chat: the tokenizer has no chat template (an instruct model's "
                         "tokenizer_config.json carries one)", file=str(path))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
