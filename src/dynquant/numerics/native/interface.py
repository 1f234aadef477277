"""The Python side of ``kernels.h``: its descriptor structs as ``ctypes.Structure``s and one table
of the exported functions' signatures, applied to the loaded library by :func:`bind`.

``tests/numerics/test_native_interface.py`` holds this file to the header: each Structure's size and field
offsets against the compiled library's own (``dq_layout``), each signature against the header's
prototype. Pointers to tensor memory are ``c_void_p`` (an address the caller keeps alive);
pointers to other descriptors are typed.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int32, c_int64, c_void_p

# kernels.h's enums
PAIRS_MATVEC, PAIRS_VECMAT, PAIRS_MATVEC_Q8, PAIRS_MATVEC_Q16 = 0, 1, 2, 3
PRODUCT_PACKED, PRODUCT_PACKED_Q8, PRODUCT_DENSE_F32, PRODUCT_DENSE_BF16, PRODUCT_PACKED_Q16 = range(5)
LAYER_ATTENTION, LAYER_CONVOLUTION = 0, 1
MLP_DENSE, MLP_EXPERTS, MLP_HYBRID_EXPERTS = 0, 1, 2
ROUTER_SOFTMAX, ROUTER_SIGMOID = 0, 1


class PackedBlock(ctypes.Structure):
    """``dq_packed_block``: a block of packed rows prepared for one-token products."""

    c_name = "dq_packed_block"
    _fields_ = [("qweight", c_void_p), ("scales", c_void_p), ("offsets", c_void_p),
                ("rows", c_int64), ("padded_n", c_int64), ("gs", c_int64),
                ("in_features", c_int64), ("bits", c_int32), ("threads", c_int32)]


class ExpertPairsBlock(ctypes.Structure):
    """``dq_expert_pairs``: an expert bank prepared for ``dq_experts_one``."""

    c_name = "dq_expert_pairs"
    _fields_ = [("qweight", c_void_p), ("scales", c_void_p), ("offsets", c_void_p),
                ("rows_per_expert", c_int64), ("padded_n", c_int64), ("gs", c_int64),
                ("in_features", c_int64), ("experts", c_int64), ("min_work", c_int64),
                ("bits", c_int32), ("kind", c_int32), ("threads", c_int32),
                ("reserved", c_int32)]


class Product(ctypes.Structure):
    """``dq_product``: one of the decode step's products (``weight``: a PackedBlock's address
    for the packed kinds, else a dense matrix)."""

    c_name = "dq_product"
    _fields_ = [("weight", c_void_p), ("bias", c_void_p), ("rows", c_int64), ("cols", c_int64),
                ("kind", c_int32), ("threads", c_int32)]


class DecodeLayer(ctypes.Structure):
    """``dq_decode_layer``: one decoder layer of a decode program."""

    c_name = "dq_decode_layer"
    _fields_ = [("norm", c_void_p), ("mlp_norm", c_void_p),
                ("q", POINTER(Product)), ("k", POINTER(Product)), ("v", POINTER(Product)),
                ("o", POINTER(Product)), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("keys", c_void_p), ("values", c_void_p),
                ("in_proj", POINTER(Product)), ("out_proj", POINTER(Product)),
                ("conv_weight", c_void_p), ("conv_bias", c_void_p), ("conv_state", c_void_p),
                ("conv_kernel", c_int64),
                ("gate", POINTER(Product)), ("up", POINTER(Product)), ("down", POINTER(Product)),
                ("router", POINTER(Product)), ("expert_gate", POINTER(ExpertPairsBlock)),
                ("expert_up", POINTER(ExpertPairsBlock)),
                ("expert_down", POINTER(ExpertPairsBlock)), ("expert_bias", c_void_p),
                ("top_k", c_int64), ("expert_intermediate", c_int64), ("kind", c_int32),
                ("mlp_kind", c_int32), ("router_kind", c_int32), ("renormalize", c_int32),
                ("qk_norm_all_heads", c_int32), ("routed_scaling", c_float)]


class DecodeProgram(ctypes.Structure):
    """``dq_decode_program``: a model's decode step."""

    c_name = "dq_decode_program"
    _fields_ = [("layers", POINTER(DecodeLayer)), ("final_norm", c_void_p),
                ("inv_freq", c_void_p), ("head", POINTER(Product)), ("layer_count", c_int64),
                ("hidden", c_int64), ("heads", c_int64), ("kv_heads", c_int64),
                ("head_dim", c_int64), ("intermediate", c_int64), ("capacity", c_int64),
                ("attention_min_macs", c_int64), ("attention_threads", c_int32),
                ("cache_half", c_int32), ("rms_eps", c_float), ("rope_scaling", c_float),
                ("attention_scale", c_float), ("reserved", c_float)]


DESCRIPTORS = (PackedBlock, ExpertPairsBlock, Product, DecodeLayer, DecodeProgram)

_p, _i64, _int, _f32 = c_void_p, c_int64, c_int, c_float
# (restype, argtypes) of every function kernels.h declares, in its order
_ROWS = [_p, _p, _p, _i64, _i64, _i64, _int]  # qweight, scales, offsets, rows, padded_n, gs, bits
_EXPERTS = [*_ROWS, _p, _i64, _p, _p]  # + experts, pairs, x, y
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "dq_layout": (_i64, [ctypes.c_char_p, ctypes.c_char_p]),
    "dq_layout_fields": (_i64, [ctypes.c_char_p]),
    "dq_quantize_rows": (_int, [_p, _int, _i64, _i64, _i64, _int, _p, _int, _p, _p, _p, _p, _p,
                                _p, _p]),
    "dq_dequantize_rows": (_int, [*_ROWS, _p, _int, _int]),
    "dq_dequantize_rows_mt": (_int, [*_ROWS, _p, _int, _int, _int]),
    "dq_dequantize_int4pack": (_int, [_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _int]),
    "dq_dequantize_int4pack_mt": (_int, [_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _p,
                                         _int, _int]),
    "dq_matvec_has_simd": (_int, []),
    "dq_matvec": (_int, [*_ROWS, _p, _i64, _p, _i64, _int]),
    "dq_matvec_mt": (_int, [*_ROWS, _p, _i64, _p, _i64, _int, _int]),
    "dq_matvec_tokens_mt": (_int, [*_ROWS, _p, _i64, _p, _i64, _int]),
    "dq_matvec_one": (_int, [POINTER(PackedBlock), _p, _p]),
    "dq_q8_simd": (_int, []),
    "dq_q8_quantize": (None, [_p, _i64, _p, _p]),
    "dq_q8_group_dots": (_int, [_p, _i64, _i64, _i64, _int, _p, _p, _int]),
    "dq_matvec_q8_mt": (_int, [*_ROWS, _p, _i64, _p, _i64, _int, _int]),
    "dq_matvec_q8_one": (_int, [POINTER(PackedBlock), _p, _p]),
    "dq_q16_quantize": (None, [_p, _i64, _i64, _p, _p]),
    "dq_q16_group_dots": (_int, [_p, _i64, _i64, _i64, _int, _p, _p, _int]),
    "dq_matvec_q16_mt": (_int, [*_ROWS, _p, _i64, _p, _i64, _int, _int]),
    "dq_matvec_q16_one": (_int, [POINTER(PackedBlock), _p, _p]),
    "dq_vecmat": (_int, [*_ROWS, _p, _i64, _i64, _i64, _p, _int]),
    "dq_vecmat_mt": (_int, [*_ROWS, _p, _i64, _p, _int, _int]),
    "dq_gemm_tile": (_int, []),
    "dq_gemm": (_int, [*_ROWS, _p, _i64, _i64, _p, _i64, _int]),
    "dq_gemm_t": (_int, [*_ROWS, _p, _i64, _i64, _i64, _p, _int]),
    "dq_gemm_mt": (_int, [*_ROWS, _p, _i64, _i64, _p, _i64, _int, _int]),
    "dq_gemm_t_mt": (_int, [*_ROWS, _p, _i64, _p, _int, _int]),
    "dq_matvec_experts": (_int, [*_EXPERTS, _i64, _i64, _int]),
    "dq_vecmat_experts": (_int, [*_EXPERTS, _i64, _i64, _int]),
    "dq_matvec_experts_mt": (_int, [*_EXPERTS, _int, _int]),
    "dq_vecmat_experts_mt": (_int, [*_EXPERTS, _int, _int]),
    "dq_matvec_integer_experts_mt": (_int, [_int, *_EXPERTS, _int]),
    "dq_experts_one": (_int, [POINTER(ExpertPairsBlock), _p, _i64, _p, _p]),
    "dq_dense_matvec_bf16_mt": (_int, [_p, _i64, _i64, _p, _i64, _p, _i64, _int]),
    "dq_decode_step": (_int, [POINTER(DecodeProgram), _p, _i64, _p]),
    "dq_rounding_step": (_i64, [_p, _int, _p, _p, _i64, _p, _p, _p, _p, _p, _p, _int, _int]),
    "dq_tunable_forward": (_int, [_p, _p, _p, _i64, _i64, _i64, _p, _int]),
    "dq_tunable_forward_bf16": (_int, [_p, _p, _p, _i64, _i64, _i64, _p, _int]),
    "dq_tunable_backward": (_int, [_p, _int, _p, _i64, _i64, _i64, _p, _p, _int]),
    "dq_tunable_backward_packed": (_int, [_p, _p, _i64, _i64, _i64, _int, _p, _p, _int]),
    "dq_gptq_columns": (_int, [_p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _p,
                               _p, _p, _p, _p, _int, _int]),
    "dq_pool_hold": (None, [_int]),
}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give every function of ``SIGNATURES`` its argument and result types; returns ``lib``."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


__all__ = ["DESCRIPTORS", "SIGNATURES", "DecodeLayer", "DecodeProgram", "ExpertPairsBlock",
           "PackedBlock", "Product", "bind"]
