"""Bit packing of codes into uint32 words (stored as int32 bit patterns).

The ``words_per_group = bits * group_size / 32`` words of one group form a little-endian bit
stream: code ``i`` occupies stream bits ``[i*bits, (i+1)*bits)``, and stream bit ``k`` is bit
``k % 32`` (LSB first) of word ``k // 32``. 3-, 5- and 6-bit codes straddle words; no bit is wasted.

Because every supported group size is a multiple of 32, a row's stream is a run of independent
32-code chunks of exactly ``bits`` words each. The fast paths below work chunk-wise, vectorised over
all chunks, with a short Python loop over the 32 code positions; ``*_ref`` are the plain
bit-by-bit definitions the fast paths are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

CHUNK_CODES = 32
_MASK32 = 0xFFFFFFFF


@cache
def _chunk_plan(bits: int) -> tuple[tuple[int, int, int, bool], ...]:
    """For each code position in a 32-code chunk: (code, word, shift, straddles into word+1)."""
    plan = []
    for i in range(CHUNK_CODES):
        pos = i * bits
        word, shift = divmod(pos, 32)
        plan.append((i, word, shift, shift + bits > 32))
    return tuple(plan)


def _to_int32_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 tensors holding the same 32-bit patterns."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` [rows, n] (n a multiple of 32, values < 2^bits) into int32 [rows, n*bits/32]."""
    rows, n = codes.shape
    chunks = codes.reshape(rows, n // CHUNK_CODES, CHUNK_CODES).to(torch.int64)
    words = torch.zeros(rows, n // CHUNK_CODES, bits, dtype=torch.int64)
    for i, word, shift, straddles in _chunk_plan(bits):
        code = chunks[:, :, i]
        words[:, :, word] |= (code << shift) & _MASK32
        if straddles:
            words[:, :, word + 1] |= code >> (32 - shift)
    return _to_int32_bits(words.reshape(rows, n * bits // 32))


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 [rows, w] -> uint8 codes [rows, w*32/bits]."""
    rows, nwords = qweight.shape
    words = (qweight.to(torch.int64) & _MASK32).reshape(rows, nwords // bits, bits)
    codes = torch.empty(rows, nwords // bits, CHUNK_CODES, dtype=torch.int64)
    mask = (1 << bits) - 1
    for i, word, shift, straddles in _chunk_plan(bits):
        code = words[:, :, word] >> shift
        if straddles:
            code = code | (words[:, :, word + 1] << (32 - shift))
        codes[:, :, i] = code & mask
    return codes.reshape(rows, nwords * 32 // bits).to(torch.uint8)


def pack_group_ref(codes: Sequence[int], bits: int) -> list[int]:
    """Reference: the words (as unsigned ints) of one group's bit stream, bit by bit."""
    nbits = len(codes) * bits
    words = [0] * (-(-nbits // 32))
    for i, code in enumerate(codes):
        for b in range(bits):
            if (code >> b) & 1:
                k = i * bits + b
                words[k // 32] |= 1 << (k % 32)
    return words


def unpack_group_ref(words: Sequence[int], bits: int, count: int) -> list[int]:
    """Reference: ``count`` codes read back from one group's words (unsigned ints), bit by bit."""
    codes = []
    for i in range(count):
        code = 0
        for b in range(bits):
            k = i * bits + b
            code |= ((words[k // 32] >> (k % 32)) & 1) << b
        codes.append(code)
    return codes


def pack_codes_ref(codes: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """Reference for :func:`pack_codes`, group by group: int32 array [rows, num_groups * wpg]."""
    rows, n = codes.shape
    out = []
    for r in range(rows):
        row: list[int] = []
        for g in range(0, n, group_size):
            row.extend(pack_group_ref([int(c) for c in codes[r, g : g + group_size]], bits))
        out.append(row)
    return np.array(out, dtype=np.uint32).reshape(rows, -1).view(np.int32)
