"""A tunable tensor used a part of its rows at a time (the end-to-end pass's head and embedding):
the same values and gradients as the whole dequantized weight, its codes held or read from a
file where they are used."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dynquant.numerics import tunable_rows as rows_module
from dynquant.numerics.quantizer import quantize_tensor
from dynquant.numerics.tunable_rows import tunable_product, tunable_rows
from dynquant.numerics.tuned_scales import TunableScales


def _tunables(bits: int, shape=(300, 90), group_size: int = 32) -> tuple[TunableScales, ...]:
    """The same tensor twice: codes held, and codes read through a loader (``start`` holding a
    meta tensor), every loaded copy counted; scales and offsets moved off GPTQ's."""
    start = quantize_tensor(torch.randn(*shape, generator=torch.Generator().manual_seed(bits)),
                            bits, group_size)
    held = TunableScales(start)
    loads: list[int] = []
    read = TunableScales(replace(start, qweight=start.qweight.to("meta")),
                         codes=lambda: loads.append(1) or start.qweight.clone())
    read.loads = loads
    gen = torch.Generator().manual_seed(7)
    for t in (held, read):
        with torch.no_grad():
            t.a.copy_(torch.randn(t.a.shape, generator=gen) * 0.05)
            t.b.copy_(torch.randn(t.b.shape, generator=gen) * 0.05)
        gen.manual_seed(7)
    return held, read


def _grads(out: torch.Tensor, grad: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, grad))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codes_read_where_they_are_used_give_the_held_codes_values_and_gradients(bits):
    """A tunable whose codes come from a loader dequantizes and differentiates bit for bit as
    one holding them, reads them once a use, and writes the same codes."""
    held, read = _tunables(bits)
    grad = torch.randn(300, 90, generator=torch.Generator().manual_seed(1))
    w_held, w_read = held(), read()
    assert torch.equal(w_held, w_read)
    for a, b in zip(_grads(w_held, grad, held.a, held.b), _grads(w_read, grad, read.a, read.b),
                    strict=True):
        assert torch.equal(a, b)
    assert len(read.loads) == 1  # the forward's read; the backward sums from what it kept
    assert torch.equal(read.codes().qweight, held.codes().qweight)


@pytest.mark.parametrize("bits", [3, 4])
def test_a_product_in_chunks_of_rows_is_the_whole_weight_s(monkeypatch, bits):
    """``x @ w.T`` a chunk of rows at a time (chunks of 7 rows of 300: the last one short; a
    padded last group): the whole dequantized weight's product and its gradients in the input,
    the scales and the offsets, to float32's rounding."""
    monkeypatch.setattr(rows_module, "CHUNK_ELEMENTS", 7 * 96)
    held, read = _tunables(bits)
    x = torch.randn(2, 5, 90, generator=torch.Generator().manual_seed(2), requires_grad=True)
    grad = torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(3))
    whole = x @ held().T
    chunked = tunable_product(x, read)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(chunked, grad, x, read.a, read.b),
                    _grads(whole, grad, x, held.a, held.b), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_lookup_of_some_rows_is_the_whole_weight_s_and_moves_only_theirs():
    """Rows 3, 0 and 299 of the weight: those of the whole dequantized weight, and gradients in
    the scales and offsets on their groups alone, the whole weight's."""
    held, read = _tunables(4)
    rows = torch.tensor([3, 0, 299])
    grad = torch.randn(3, 90, generator=torch.Generator().manual_seed(4))
    picked = tunable_rows(rows, read)
    whole = held()[rows]
    assert torch.equal(picked, whole)
    grads = _grads(picked, grad, read.a, read.b)
    for a, b in zip(grads, _grads(whole, grad, held.a, held.b), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    moved = torch.zeros(300, dtype=torch.bool)
    moved[rows] = True
    assert not grads[0][~moved].any() and grads[0][moved].abs().sum(1).all()
