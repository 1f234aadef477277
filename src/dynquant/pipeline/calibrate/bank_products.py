"""Seeing each expert's products: which tokens reach which expert of a bank, whatever the
model's routing code looks like.

An expert bank is one 3-D parameter; a model multiplies by one expert at a time through a view
of it: ``F.linear(x, bank[e])`` in transformers' experts modules (stored ``[E, out, in]``) or
``x @ bank[e]`` in the reference hybrid model (``[E, in, out]``). A torch function mode sees
every such product, with the tokens routed to that expert as its input."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

# x @ w reaches the mode as the tensor method ``matmul``
_PRODUCTS = (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)

# seen(bank name, expert, input [tokens, in], rows): ``rows`` for x @ bank[e] ([E, in, out])
Seen = Callable[[str, int, torch.Tensor, bool], None]


class BankProducts(TorchFunctionMode):
    """Calls ``seen(name, expert, input, rows)`` for every product whose weight is one expert
    of a watched bank."""

    def __init__(self, banks: dict[str, nn.Parameter], seen: Seen) -> None:
        super().__init__()
        self.banks, self.seen = banks, seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        x, w = (*args, None, None)[:2]
        if func in _PRODUCTS and isinstance(w, torch.Tensor):
            for name, bank in self.banks.items():
                if (tuple(w.shape) == tuple(bank.shape[1:]) and w.numel()
                        and w.untyped_storage().data_ptr() == bank.untyped_storage().data_ptr()):
                    expert = (w.storage_offset() - bank.storage_offset()) // bank.stride(0)
                    self.seen(name, expert, x, func is not F.linear)
        return func(*args, **(kwargs or {}))
