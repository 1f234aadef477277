"""Plain reference implementations (numpy, one group at a time) that the fast paths are held to.

Slow on purpose: every step is written the way the format documentation states it.
"""

from __future__ import annotations

import numpy as np

from dynquant.format.packing import pack_group_ref, unpack_group_ref
from dynquant.numerics.quantizer import CLIP_ALPHAS


def round_bf16_ref(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), returned as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def lane_sum_ref(values: np.ndarray) -> np.float32:
    """The format's float32 summation order: value j into lane j % 16, each lane in order, then
    lanes l and l + 8 added, then l and l + 4, then (s0 + s2) + (s1 + s3)."""
    lanes = [np.float32(0.0)] * 16
    for j, v in enumerate(np.asarray(values, dtype=np.float32)):
        lanes[j % 16] = np.float32(lanes[j % 16] + v)
    s8 = [np.float32(lanes[k] + lanes[k + 8]) for k in range(8)]
    s4 = [np.float32(s8[k] + s8[k + 4]) for k in range(4)]
    return np.float32(np.float32(s4[0] + s4[2]) + np.float32(s4[1] + s4[3]))


def quantize_group_ref(values: np.ndarray, bits: int, weight: np.ndarray | None = None,
                       clip: bool = True) -> tuple[list[int], np.float32, np.float32]:
    """Codes, scale and offset of one group of real values (no padding), as the spec says.

    The error of a candidate is ``scale^2 * sum imp * (q - x)^2`` with ``x = (w - offset) /
    scale`` (``sum imp * (w - offset)^2`` for a constant group), float32, summed by
    :func:`lane_sum_ref`; the first alpha with the least error wins."""
    w = np.asarray(values, dtype=np.float32)
    imp = np.ones_like(w) if weight is None else np.asarray(weight, dtype=np.float32)
    max_code = (1 << bits) - 1
    best = None
    for alpha in CLIP_ALPHAS if clip and bits < 8 else (1.0,):
        a = np.float32(alpha)
        lo, hi = w.min() * a, w.max() * a
        scale = round_bf16_ref(np.float32((hi - lo) / np.float32(max_code)))[()]
        offset = round_bf16_ref(lo)[()]
        if scale == 0:
            q = np.zeros_like(w)
            err = lane_sum_ref((w - offset) ** 2 * imp)
        else:
            x = (w - offset) / scale
            q = np.clip(np.round(x), 0, max_code)
            err = np.float32(lane_sum_ref((q - x) ** 2 * imp) * np.float32(scale * scale))
        if best is None or err < best[0]:
            best = (err, q, scale, offset)
    _, q, scale, offset = best
    return [int(c) for c in q], np.float32(scale), np.float32(offset)


def dequantize_ref(qweight: np.ndarray, scales: np.ndarray, offsets: np.ndarray, bits: int,
                   group_size: int, in_features: int) -> np.ndarray:
    """float32 [rows, in_features] from int32 words and float32 scales/offsets, group by group."""
    rows, groups = scales.shape
    wpg = bits * group_size // 32
    out = np.zeros((rows, groups * group_size), dtype=np.float32)
    words = qweight.view(np.uint32)
    for r in range(rows):
        for g in range(groups):
            codes = unpack_group_ref([int(x) for x in words[r, g * wpg:(g + 1) * wpg]], bits,
                                     group_size)
            q = np.array(codes, dtype=np.float32)
            out[r, g * group_size:(g + 1) * group_size] = q * scales[r, g] + offsets[r, g]
    return out[:, :in_features]


__all__ = ["dequantize_ref", "lane_sum_ref", "pack_group_ref", "quantize_group_ref",
           "round_bf16_ref"]
