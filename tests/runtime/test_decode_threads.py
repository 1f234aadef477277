"""Decode steps of a packed model run torch's own ops on one thread (runtime/decode_threads.py):
lowered from the first decode step to the end of ``generate``, restored for prefill, after a
one-token forward outside ``generate``, after an error, and for long caches; the kernel pool
keeps its threads; the tokens are the same."""

from __future__ import annotations

import copy

import pytest
import torch

from dynquant.numerics import native
from dynquant.runtime import decode_threads
from dynquant.runtime.loader import load


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", 3)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _record(model):
    """(query tokens, torch threads, kernel threads) at each forward of ``model``."""
    seen = []
    model.register_forward_pre_hook(  # after the policy's own pre-hook
        lambda m, args, kwargs: seen.append((decode_threads._tokens(args, kwargs),
                                             torch.get_num_threads(), native.kernel_threads())),
        with_kwargs=True)
    return seen


def test_generate_lowers_torch_for_decode_steps_only(checkpoint, two_threads, monkeypatch):
    model = load(checkpoint, dtype=torch.float32)
    seen = _record(model)
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert seen[0] == (6, 2, 2)  # the prompt: torch's threads
    assert seen[1:] == [(1, 1, 2)] * 4  # decode steps: torch on one, the kernel pool on two
    assert torch.get_num_threads() == 2 and native.pool_threads is None
    twin = copy.deepcopy(model)  # its own generate and hooks, not the original's
    assert twin.generate.model is twin and twin.generate.hooks is not model.generate.hooks
    assert [h.__self__ for h in twin._forward_pre_hooks.values()
            if hasattr(h, "__self__")] == [twin.generate.hooks]  # its hooks drive its generate
    with torch.no_grad():
        assert torch.equal(twin.generate(ids, max_new_tokens=5, min_new_tokens=5,
                                         do_sample=False), out)
    monkeypatch.setenv("DYNQUANT_DECODE_THREADS", "0")  # the same tokens with torch's threads
    plain = load(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(out, plain.generate(ids, max_new_tokens=5, min_new_tokens=5,
                                               do_sample=False))


def test_a_forward_outside_generate_and_errors_restore_the_count(checkpoint, two_threads):
    model = load(checkpoint, dtype=torch.float32)
    seen = _record(model)
    with torch.no_grad():
        out = model(torch.tensor([[3, 4, 5]]), use_cache=True)
        model(torch.tensor([[6]]), cache=out.past_key_values, use_cache=True)
    assert seen == [(3, 2, 2), (1, 1, 2)] and torch.get_num_threads() == 2

    def fail_in_decode(module, args, kwargs, output):
        if decode_threads._tokens(args, kwargs) == 1:
            raise ZeroDivisionError

    model.register_forward_hook(fail_in_decode, with_kwargs=True)
    with torch.no_grad(), pytest.raises(ZeroDivisionError):  # a one-token forward
        model(torch.tensor([[7]]), cache=out.past_key_values, use_cache=True)
    assert torch.get_num_threads() == 2 and native.pool_threads is None
    with torch.no_grad(), pytest.raises(ZeroDivisionError):  # a decode step inside generate
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, do_sample=False)
    assert seen[-1] == (1, 1, 2)  # it had lowered the count, and generate gave it back
    assert torch.get_num_threads() == 2 and native.pool_threads is None


def test_long_caches_and_the_switch_keep_torchs_threads(checkpoint, two_threads, monkeypatch):
    monkeypatch.setattr(decode_threads, "MAX_CACHE_BYTES", 0)  # every cache is long
    model = load(checkpoint, dtype=torch.float32)
    seen = _record(model)
    with torch.no_grad():
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, min_new_tokens=3,
                       do_sample=False)
    assert [threads for _, threads, _ in seen] == [2, 2, 2]
    monkeypatch.undo()
    monkeypatch.setenv("DYNQUANT_DECODE_THREADS", "0")
    model = load(checkpoint, dtype=torch.float32)
    assert not isinstance(model.generate, decode_threads._Generate)
    seen = _record(model)
    with torch.no_grad():
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, min_new_tokens=3,
                       do_sample=False)
    assert [threads for _, threads, _ in seen] == [2, 2, 2]


def test_kv_bytes_per_token_counts_the_attention_layers():
    from transformers import LlamaConfig

    from dynquant.models.hybrid.configuration import DynquantHybridConfig

    llama = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=3, head_dim=64)
    assert decode_threads.kv_bytes_per_token(llama, torch.float32) == 2 * 3 * 2 * 64 * 4
    hybrid = DynquantHybridConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=64, num_hidden_layers=4, attention_layers=[1, 3])
    assert decode_threads.kv_bytes_per_token(hybrid, torch.bfloat16) == 2 * 2 * 2 * 64 * 2
