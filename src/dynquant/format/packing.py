"""Bit packing of codes into uint32 words (stored as int32 bit patterns).

The ``words_per_group = bits * group_size / 32`` words of one group form a little-endian bit
stream: code ``i`` occupies stream bits ``[i*bits, (i+1)*bits)``, and stream bit ``k`` is bit
``k % 32`` (LSB first) of word ``k // 32``. 3-, 5- and 6-bit codes straddle words; no bit is wasted.

Because every supported group size is a multiple of 32, a row's stream is the concatenation of its
groups' streams. The fast paths work on 8-code units (exactly ``bits`` bytes), vectorised over all
units with a loop over the 8 positions in uint8 arithmetic; ``*_ref`` are the plain bit-by-bit
definitions the fast paths are tested against.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

# The stream is little-endian bit by bit, so on a little-endian machine it is exactly the byte
# sequence of the int32 words: the fast paths work on bytes.
assert sys.byteorder == "little", "dynquant's fast packing assumes a little-endian machine"

# 8 codes of b bits fill exactly b bytes: the unit the byte-wise paths work on.
UNIT_CODES = 8


@cache
def _unit_plan(bits: int) -> tuple[tuple[int, int, bool], ...]:
    """For each code of an 8-code unit: (byte, shift, spills into byte + 1)."""
    return tuple((i * bits // 8, i * bits % 8, i * bits % 8 + bits > 8)
                 for i in range(UNIT_CODES))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` [rows, n] (n a multiple of 32, values < 2^bits) into int32 [rows, n*bits/32]."""
    rows, n = codes.shape
    units = codes.to(torch.uint8).reshape(rows, n // UNIT_CODES, UNIT_CODES)
    out = torch.zeros(rows, n // UNIT_CODES, bits, dtype=torch.uint8)
    for i, (byte, shift, spills) in enumerate(_unit_plan(bits)):
        code = units[:, :, i]
        out[:, :, byte] |= code << shift  # uint8 arithmetic drops the bits that spill over
        if spills:
            out[:, :, byte + 1] |= code >> (8 - shift)
    return out.reshape(rows, n * bits // 8).view(torch.int32)


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 [rows, w] -> uint8 codes [rows, w*32/bits]."""
    rows = qweight.shape[0]
    stream = qweight.contiguous().view(torch.uint8)
    mask = (1 << bits) - 1
    if bits == 8:
        return stream.clone()
    if 8 % bits == 0:  # whole codes per byte: one broadcast shift
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        return ((stream.unsqueeze(-1) >> shifts) & mask).reshape(rows, -1)
    units = stream.reshape(rows, -1, bits)
    out = torch.empty(rows, units.shape[1], UNIT_CODES, dtype=torch.uint8)
    for i, (byte, shift, spills) in enumerate(_unit_plan(bits)):
        code = units[:, :, byte] >> shift
        if spills:
            code = code | (units[:, :, byte + 1] << (8 - shift))
        out[:, :, i] = code & mask
    return out.reshape(rows, -1)


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
