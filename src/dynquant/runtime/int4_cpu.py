"""torch's CPU int4 weight-only kernel for 4-bit modules whose groups run along the input dim.

``_weight_int4pack_mm_for_cpu`` computes ``(q - 8) * scale + zero``; ours is
``q * scale + offset``, so ``zero = offset + 8 * scale`` (rounded to bf16, as the kernel takes it).

The kernel serves decode and short prefills (1-32 tokens: 1.2-1.8x our bf16 paths at 3072 x 1024),
but at 512 tokens it runs at ~0.37x the bf16 GEMM of the same matrix; long prefills dequantize row
blocks from the kernel's copy of the codes (``dequantize_int4_rows``, the format's exact values:
the module keeps its own bf16 offsets beside the kernel's rounded zero points) for that GEMM.
Reading the kernel's layout relies on what ``_convert_weight_to_int4pack_for_cpu`` writes: blocks
of 64 rows where torch runs its AVX-512 kernels, 32 with AVX2 (``ATEN_CPU_CAPABILITY``), found on a
probe once per process (``layout_block_rows``); where neither fits the kernel serves every size.
"""

from __future__ import annotations

from functools import cache

import torch

from dynquant.format.packing import unpack_codes
from dynquant.numerics import native, row_kernels

INNER_K_TILES = 1
BLOCK_ROWS = (64, 32)  # the row blocks torch's layout is known with (see unpack_int4_codes)


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    # the packing op itself refuses out_features that 16 does not divide
    return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and in_features % group_size == 0 and in_features % 32 == 0
            and out_features % 16 == 0)


def unpack_int4_codes(packed: torch.Tensor, out_features: int, in_features: int,
                      block_rows: int) -> torch.Tensor:
    """The plain reference for the kernel's layout: int32 codes [out, in] from the packed bytes.
    Rows in blocks of ``block_rows`` (B), a block ``[in][B / 2]`` bytes with row d in the low
    nibble of byte d and row d + B / 2 in its high nibble; a last block of nb < B rows
    ``[in][nb / 2]`` bytes, rows 2j and 2j + 1 in byte j."""
    flat = packed.reshape(-1).to(torch.int32)
    codes = torch.empty(out_features, in_features, dtype=torch.int32)
    for r in range(0, out_features, block_rows):
        rows = min(block_rows, out_features - r)
        block = flat[r * in_features // 2:(r + rows) * in_features // 2].view(in_features, rows // 2)
        low, high = (block & 15).T, (block >> 4).T
        if rows == block_rows:
            codes[r:r + rows // 2], codes[r + rows // 2:r + rows] = low, high
        else:
            codes[r:r + rows:2], codes[r + 1:r + rows:2] = low, high
    return codes


@cache
def layout_block_rows() -> int | None:
    """The row blocks of the layout this process's torch writes, where ``unpack_int4_codes``
    reads it (a probe of 80 rows: full blocks and a last partial one tell 64 from 32); None
    where it reads neither."""
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return None
    codes = torch.randint(0, 16, (80, 64), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
    if packed.numel() * 2 != codes.numel():
        return None
    return next((b for b in BLOCK_ROWS if torch.equal(unpack_int4_codes(packed, 80, 64, b), codes)),
                None)


def layout_is_known() -> bool:
    return layout_block_rows() is not None


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


def dequantize_int4_rows(packed: torch.Tensor, scale_zero: torch.Tensor, offsets: torch.Tensor,
                         group_size: int, start: int, stop: int, dtype: torch.dtype,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, stop) of the module, ``q * scale + offset`` in float32 then ``dtype``: the
    values ``quantizer.dequantize`` gives from the format's own tensors. ``offsets`` is the
    module's [out, groups] bf16 offsets; the native kernel where available (bit-identical),
    else the reference. Raises ValueError where the layout is not known (``layout_is_known``)."""
    rows, groups = offsets.shape
    in_features = groups * group_size
    block_rows = layout_block_rows()
    if block_rows is None:
        raise ValueError("torch's int4 layout is not one dynquant reads")
    lib = native.library()
    if lib is None or dtype not in native.INPUT_DTYPES:
        codes = unpack_int4_codes(packed, rows, in_features, block_rows)[start:stop].float()
        s = scale_zero[:, start:stop, 0].T.float().repeat_interleave(group_size, dim=1)
        o = offsets[start:stop].float().repeat_interleave(group_size, dim=1)
        w = (codes * s + o).to(dtype)
        return w if out is None else out.copy_(w)
    if out is None:
        out = torch.empty(stop - start, in_features, dtype=dtype)
    packed, scale_zero, offsets = packed.contiguous(), scale_zero.contiguous(), offsets.contiguous()
    if lib.dq_dequantize_int4pack_mt(
            packed.data_ptr(), scale_zero.data_ptr(), offsets.data_ptr(), rows, in_features,
            group_size, block_rows, start, stop, out.data_ptr(), native.INPUT_DTYPES[dtype],
            native.threads_for(out.numel(), row_kernels.DEQUANT_PARALLEL_MIN_ELEMENTS)):
        raise ValueError(f"int4 layout dequantization: unsupported shape {rows} x {in_features}")
    return out
