"""torch's CPU int4 weight-only kernel for 4-bit modules whose groups run along the input dim.

``_weight_int4pack_mm_for_cpu`` computes ``(q - 8) * scale + zero``; ours is
``q * scale + offset``, so ``zero = offset + 8 * scale`` (rounded to bf16, as the kernel takes it).
"""

from __future__ import annotations

import torch

from dynquant.format.packing import unpack_codes

INNER_K_TILES = 1


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and in_features % group_size == 0 and in_features % 32 == 0
            and out_features % 8 == 0)


def pack_int4(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Our 4-bit module -> (kernel's packed weight, kernel's [groups, out, 2] scale/zero)."""
    codes = unpack_codes(qweight, 4).to(torch.int32)  # (out, in)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
    s, o = scales.float(), offsets.float()
    scale_zero = torch.stack([s, o + 8 * s], dim=-1).transpose(0, 1).contiguous()
    return packed, scale_zero.to(torch.bfloat16)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x (..., in) in any float dtype -> (..., out) in x's dtype, via bf16 activations."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group_size, scale_zero)
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)
