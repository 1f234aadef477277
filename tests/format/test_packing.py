"""Pack/unpack against the bit-by-bit reference, at every width and group size."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynquant.format.packing import (
    pack_codes,
    pack_codes_ref,
    pack_group_ref,
    unpack_codes,
    unpack_group_ref,
)
from dynquant.format.widths import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, width


@st.composite
def code_arrays(draw):
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    gs = draw(st.sampled_from(SUPPORTED_GROUP_SIZES))
    rows = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, size=(rows, groups * gs), dtype=np.int64)
    return bits, gs, codes


@settings(max_examples=60, deadline=None)
@given(code_arrays())
def test_pack_matches_reference_and_round_trips(case):
    bits, gs, codes = case
    packed = pack_codes(torch.from_numpy(codes), bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (codes.shape[0], codes.shape[1] // gs * width(bits, gs).words_per_group)
    np.testing.assert_array_equal(packed.numpy(), pack_codes_ref(codes, bits, gs))
    np.testing.assert_array_equal(unpack_codes(packed, bits).numpy(), codes)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SUPPORTED_BITS), st.lists(st.integers(0, 255), min_size=32, max_size=32))
def test_group_reference_round_trips(bits, raw):
    codes = [c % (1 << bits) for c in raw]
    assert unpack_group_ref(pack_group_ref(codes, bits), bits, 32) == codes


def test_worked_example_3bit_codes_10_and_11():
    # docs/format.md: in a 3-bit group, code 10 occupies stream bits 30..32 (bits 30, 31 of word
    # 0 and bit 0 of word 1); code 11 occupies bits 33..35 (bits 1..3 of word 1).
    codes = [0] * 128
    codes[10] = 0b101
    codes[11] = 0b011
    words = pack_group_ref(codes, 3)
    assert len(words) == 12
    assert words[0] == (0b01 << 30)  # low two bits of code 10
    assert words[1] == 0b1 | (0b011 << 1)  # high bit of code 10, then code 11
    assert all(w == 0 for w in words[2:])
    packed = pack_codes(torch.tensor([codes]), 3)
    assert packed.view(torch.int32).numpy().view(np.uint32).tolist()[0] == words


def test_extreme_codes_use_full_words():
    for bits in SUPPORTED_BITS:
        codes = torch.full((1, 128), (1 << bits) - 1)
        packed = pack_codes(codes, bits)
        assert (packed == -1).all()  # every bit set: no bit wasted, none spilled
        assert torch.equal(unpack_codes(packed, bits).long(), codes)
