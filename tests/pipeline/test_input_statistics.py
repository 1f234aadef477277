"""The calibration statistics folded from shards of the windows (what a worker returns) against
the sums the hooks gather in one pass, tensor by tensor."""

from __future__ import annotations

import torch
from torch import nn

from dynquant.numerics.gram import gram_ref
from dynquant.pipeline.calibrate.statistics import InputStatistics

MODULES = {"q", "k", "down"}


class _Block(nn.Module):
    """q and k read one input one after the other (their X^T X is one accumulator, as q/k/v's
    in a decoder block), down reads another."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.down = nn.Linear(40, 24), nn.Linear(40, 8), nn.Linear(24, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        return self.down(torch.relu(q)) + k.sum(-1, keepdim=True)


def _gathered(block: nn.Module, windows: list[torch.Tensor]) -> InputStatistics:
    stats = InputStatistics(block, MODULES, second_moments=True)
    with torch.no_grad():
        for w in windows:
            block(w)
    stats.remove()
    return stats


def _folded(block: nn.Module, parts: list[InputStatistics]) -> InputStatistics:
    stats = InputStatistics(block, MODULES, second_moments=True)
    stats.remove()
    for part in parts:
        stats.add(part.partial())
    return stats


def test_moments_folded_from_shards_are_the_windows_moments():
    g = torch.Generator().manual_seed(0)
    block = _Block()
    windows = [torch.randn(2, 5, 40, generator=g) * (1 + i) for i in range(6)]
    first, second = _gathered(block, windows[:4]), _gathered(block, windows[4:])
    folded = _folded(block, [first, second])
    # the same shards computed again, the second one first (another worker done sooner), and
    # folded in the windows' order: the same bits
    later = _gathered(block, windows[4:])
    again = _folded(block, [_gathered(block, windows[:4]), later])
    inputs = torch.cat([w.reshape(-1, 40) for w in windows])
    hidden = torch.relu(block.q(inputs)).detach()
    assert folded.moments["q"] is folded.moments["k"]  # one shared accumulator, folded once
    assert folded.moments["q"].rows == folded.counts["q"] == inputs.shape[0] == 60
    for name, x in (("q", inputs), ("down", hidden)):
        mean = folded.moments[name].mean()
        torch.testing.assert_close(mean, gram_ref(x) / x.shape[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(mean, again.moments[name].mean())
        assert torch.equal(mean.T, mean)  # the lower blocks are the upper ones
        assert torch.equal(folded.sums[name], first.sums[name] + second.sums[name])
        torch.testing.assert_close(folded.sums[name], x.square().sum(0), rtol=1e-5, atol=1e-5)


def test_one_shard_folded_is_exactly_the_hooks_sums():
    """0 + x is x: a run whose windows are one shard folds to its own pass's bits."""
    g = torch.Generator().manual_seed(1)
    block = _Block()
    one = _gathered(block, [torch.randn(3, 7, 40, generator=g) for _ in range(3)])
    folded = _folded(block, [one])
    for name in MODULES:
        assert torch.equal(folded.moments[name].mean(), one.moments[name].mean())
        assert torch.equal(folded.sums[name], one.sums[name])
        assert folded.counts[name] == one.counts[name] == 63
