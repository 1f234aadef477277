"""bf16 products summed in float32 (MKL's), held to the widened product."""

from __future__ import annotations

import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynquant.numerics import float32_sums
from dynquant.numerics.float32_sums import add_product, add_product_ref


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 300),
       transpose_a=st.booleans(), transpose_b=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_products_equal_the_widened_product_to_float32_rounding(m, n, k, transpose_a,
                                                                     transpose_b, seed):
    g = torch.Generator().manual_seed(seed)
    # column blocks of wider matrices, as the Gram's strips take them
    a = torch.randn(k + 3, m + 5, generator=g).bfloat16()[1:k + 1, 2:m + 2].T if transpose_a \
        else torch.randn(m, k + 7, generator=g).bfloat16()[:, 3:k + 3]
    b = torch.randn(n + 2, k, generator=g).bfloat16()[1:n + 1].T if transpose_b \
        else torch.randn(k, n + 4, generator=g).bfloat16()[:, 4:]
    start = torch.randn(m, n, generator=g)
    got, want = start.clone(), start.clone()
    add_product(got, a, b)
    add_product_ref(want, a, b)
    exact = start.double() + a.double() @ b.double()
    scale = (a.double().abs() @ b.double().abs()).max().item() + 1
    assert (got.double() - exact).abs().max().item() <= 4e-7 * k * scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * k * scale)


def test_mkl_s_product_is_found_in_torch_s_x86_build():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("torch's MKL is an x86 build's")
    assert float32_sums._mkl_gemm_bf16() is not None


def test_mismatched_shapes_are_refused_before_any_write():
    with pytest.raises(ValueError, match="shapes"):
        add_product(torch.zeros(3, 4), torch.zeros(3, 5).bfloat16(), torch.zeros(5, 5).bfloat16())


def test_float32_and_strided_inputs_take_the_widened_product():
    a = torch.randn(6, 4)
    b = torch.randn(8, 10).bfloat16()[::2, ::2]  # both strides > 1: no BLAS layout
    got, want = torch.zeros(6, 5), torch.zeros(6, 5)
    add_product(got, a.bfloat16(), b)
    add_product_ref(want, a.bfloat16(), b)
    assert torch.equal(got, want)
