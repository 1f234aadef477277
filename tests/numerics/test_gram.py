"""Second moments as symmetric rank-k updates, held to the plain X^T X."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynquant.numerics import gram as gram_mod
from dynquant.numerics.gram import GramAccumulator, gram_ref


@settings(max_examples=25, deadline=None)
@given(width=st.integers(1, 70), block=st.integers(1, 32), chunks=st.integers(1, 3),
       seed=st.integers(0, 2**16), bf16=st.booleans())
def test_the_block_triangle_sums_to_the_whole_gram(width, block, chunks, seed, bf16):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    xs = [torch.randn(5, width, generator=g).to(dtype) for _ in range(chunks)]
    old, gram_mod.GRAM_BLOCK = gram_mod.GRAM_BLOCK, block
    try:
        acc = GramAccumulator(width)
        for x in xs:
            acc.add(x)
        got = acc.mean()
    finally:
        gram_mod.GRAM_BLOCK = old
    want = gram_ref(torch.cat(xs)) / (5 * chunks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, got.T)  # the lower blocks are the upper ones, exactly
    assert acc.rows == 5 * chunks


def test_the_sum_is_held_as_strips_above_the_diagonal_and_consumed_by_its_read():
    old, gram_mod.GRAM_BLOCK = gram_mod.GRAM_BLOCK, 4
    try:
        acc = GramAccumulator(10)
        assert [tuple(s.shape) for s in acc.strips] == [(4, 4), (8, 4), (10, 2)]
        x = torch.arange(30, dtype=torch.float32).reshape(3, 10)
        acc.add(x)
        part = GramAccumulator(10)
        part.add(x)
        acc.add_sum(part)
        got = acc.mean(consume=True)
    finally:
        gram_mod.GRAM_BLOCK = old
    assert torch.equal(got, gram_ref(x) * 2 / 6)
    assert sum(s.numel() for s in acc.strips) == 0
