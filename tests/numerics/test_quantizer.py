"""The group-wise quantizer: the reference, clip statistics, padding, importance, error bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynquant import quantize_tensor
from dynquant.errors import QuantizationError
from dynquant.format.packing import unpack_codes
from dynquant.numerics.quantizer import relative_error
from dynquant.numerics.reference import dequantize_ref, quantize_group_ref, round_bf16_ref
from quantizer_backends import BACKENDS, backend


def _ref_check(w: torch.Tensor, bits: int, gs: int, importance=None) -> None:
    qt = quantize_tensor(w, bits, gs, importance=importance)
    rows, n = w.reshape(-1, w.shape[-1]).shape
    groups = -(-n // gs)
    codes = unpack_codes(qt.qweight, bits).reshape(rows, groups, gs)
    flat = w.reshape(rows, n).numpy()
    imp = None if importance is None else importance.numpy()
    for r in range(rows):
        for g in range(groups):
            sl = slice(g * gs, min((g + 1) * gs, n))
            c, s, o = quantize_group_ref(flat[r, sl], bits, None if imp is None else imp[sl])
            assert codes[r, g, : len(c)].tolist() == c
            assert codes[r, g, len(c):].eq(0).all()  # padding is code 0
            assert qt.scales[r, g].float().item() == s
            assert qt.offsets[r, g].float().item() == o
    ref = dequantize_ref(qt.qweight.numpy(), qt.scales.float().numpy(),
                         qt.offsets.float().numpy(), bits, gs, n)
    assert torch.equal(qt.dequantize(torch.float32).reshape(rows, n), torch.from_numpy(ref))


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from((2, 3, 4, 5, 6, 8)), gs=st.sampled_from((32, 64, 128)),
       rows=st.integers(1, 3), n=st.integers(1, 300), seed=st.integers(0, 10_000))
def test_matches_reference(name, bits, gs, rows, n, seed):
    w = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))
    with backend(name):
        _ref_check(w, bits, gs)


@pytest.mark.parametrize("name", BACKENDS)
def test_matches_reference_with_importance_and_3d_bank(name):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 3, 100, generator=g)
    imp = torch.rand(100, generator=g) * 5
    with backend(name):
        _ref_check(w, 3, 64, importance=imp)


@pytest.mark.parametrize(
    ("bits", "cf_range", "ci_range"),
    [(4, (0.951, 0.960), (0.109, 0.118)), (3, (0.999, 1.0), (0.248, 0.251)),
     (2, (0.999, 1.0), (0.353, 0.356)), (8, (0.0, 0.0), (0.0, 0.0))],
)
def test_clip_statistics_conform_to_the_seed(bits, cf_range, ci_range):
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
    qt = quantize_tensor(w, bits)
    tol = 0.01
    assert cf_range[0] - tol <= qt.clipped_fraction <= cf_range[1] + tol
    assert ci_range[0] - tol <= qt.clip_improvement <= ci_range[1] + tol


@pytest.mark.parametrize("name", BACKENDS)
def test_constant_groups_are_reproduced_never_nan(name):
    w = torch.full((3, 256), 0.7)
    w[1] = 0.0
    w[2, :128] = -3.25
    for bits in (2, 3, 4, 8):
        with backend(name):
            w_hat = quantize_tensor(w, bits).dequantize(torch.float32)
        assert torch.isfinite(w_hat).all()
        assert torch.equal(w_hat, torch.from_numpy(round_bf16_ref(w.numpy())))


@pytest.mark.parametrize("n", [1, 5, 64, 100, 129, 172])
def test_in_features_not_a_multiple_of_group_size(n):
    w = torch.randn(7, n, generator=torch.Generator().manual_seed(n))
    qt = quantize_tensor(w, 4, 128)
    assert qt.dequantize().shape == (7, n)
    assert qt.scales.shape == (7, -(-n // 128))
    # with alpha = 1 the error is at most half a step, plus the bf16 rounding of the offset
    plain = quantize_tensor(w, 4, 128, clip=False)
    step = plain.scales.float().repeat_interleave(128, dim=1)[:, :n]
    lo = w.amin(1, keepdim=True).abs()
    bound = step / 2 + 1e-2 * step + lo * 2**-8
    assert ((plain.dequantize(torch.float32) - w).abs() <= bound).all()


def test_padding_never_enters_min_max():
    w = torch.linspace(5.0, 6.0, 40).reshape(1, 40)  # all positive: padding 0 would widen it
    qt = quantize_tensor(w, 4, 64, clip=False)
    assert qt.offsets.float().item() == pytest.approx(5.0, abs=0.02)


def test_error_falls_with_width_and_clip_helps():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    errs = [relative_error(w, quantize_tensor(w, b)) for b in (2, 3, 4, 5, 6, 8)]
    assert errs == sorted(errs, reverse=True)
    assert errs[-1] < 1e-4
    assert relative_error(w, quantize_tensor(w, 3)) < relative_error(
        w, quantize_tensor(w, 3, clip=False))


def test_importance_steers_the_error():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 128, generator=g)
    imp = torch.ones(128)
    imp[:8] = 1000.0
    plain = quantize_tensor(w, 2)
    weighted = quantize_tensor(w, 2, importance=imp)
    err = lambda qt: ((qt.dequantize(torch.float32) - w)[:, :8] ** 2).sum().item()  # noqa: E731
    assert err(weighted) < err(plain)


@pytest.mark.parametrize("name", BACKENDS)
def test_non_finite_weights_are_typed_errors(name):
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.randn(300, 200)
        w[257, 199] = bad  # in the last, padded group of a row of the second thread's half
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with backend(name), pytest.raises(QuantizationError, match="NaN or Inf"):
                quantize_tensor(w.to(dtype), 4)


def test_bad_inputs_are_typed_errors():
    with pytest.raises(QuantizationError, match="unsupported width 7"):
        quantize_tensor(torch.randn(4, 32), 7)
    with pytest.raises(QuantizationError, match="group size"):
        quantize_tensor(torch.randn(4, 32), 4, group_size=-128)
    with pytest.raises(QuantizationError, match="2 or more"):
        quantize_tensor(torch.randn(32), 4)
    with pytest.raises(QuantizationError, match="importance"):
        quantize_tensor(torch.randn(4, 32), 4, importance=torch.ones(3))


def test_nbytes_and_layout_entry():
    qt = quantize_tensor(torch.randn(16, 3, 1152), 3)
    assert qt.nbytes == 48 * 9 * (4 * 12 + 4)
    entry = qt.layer_entry()
    assert entry["num_rows"] == 48 and entry["words_per_group"] == 12
    assert entry["bits_per_weight"] == 3.25
    assert np.isfinite(entry["clip_improvement"])


@pytest.mark.parametrize("name", BACKENDS)
def test_matches_reference_on_near_ties(name):
    w = torch.randint(-4, 5, (24, 256), generator=torch.Generator().manual_seed(7)).float() / 4
    with backend(name):
        for bits in (2, 3):
            _ref_check(w, bits, 128)
