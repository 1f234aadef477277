"""KL of a checkpoint against the model it was quantized from, one decoder block at a time.

Both models run as block streams over the same windows (``pipeline/calibrate/block_stream.py``):
the float model's weights read from its safetensors, the checkpoint's dequantized from its codes
(``CheckpointWeights``), one block of each in memory at a time, then both heads, one window at a
time. Peak memory: a block of each and both heads in float32, and the windows' hidden states of
both models; a forward of two whole float models would hold both in float32 (2 x 28 GB at 7 B).
A block runs the same arithmetic as in the whole model's forward, so the KL is the whole
models' KL to float rounding (a chunk of windows goes through a block as one batch).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dynquant.checkpoint.reader import open_checkpoint
from dynquant.models.sources import ModelSource
from dynquant.numerics.divergence import log_probs, token_kl
from dynquant.pipeline.calibrate.block_stream import BlockStream
from dynquant.pipeline.calibrate.calibration_pass import block_as_driven
from dynquant.pipeline.calibrate.weights import CheckpointWeights, WeightSource
from dynquant.pipeline.execute.progress import StageProgress

CHUNK = 4  # windows through a block at once


def streamed_kl(source: ModelSource, weights: WeightSource, checkpoint: str | Path,
                windows: torch.Tensor, label: str = "KL on held-out windows",
                progress: bool = False) -> float:
    """Mean KL(source || checkpoint) of the next-token distributions on ``windows`` [n, length],
    nats per token; ``weights``: where the source's weights are read from."""
    streams = (BlockStream(source, weights, windows, chunk=CHUNK),
               BlockStream(source, CheckpointWeights(open_checkpoint(checkpoint)), windows,
                           chunk=CHUNK))
    with StageProgress(enabled=progress) as bar:
        task = bar.add_task(label, total=len(streams[0].blocks) + 1)
        hidden = [s.record() for s in streams]
        for index in range(len(streams[0].blocks)):
            hidden = [_through_block(s, index, h) for s, h in zip(streams, hidden, strict=True)]
            bar.advance(task)
        total = _heads_kl(streams, hidden)
        bar.advance(task)
    return total / windows.numel()


def _through_block(stream: BlockStream, index: int, hidden: list[torch.Tensor]
                   ) -> list[torch.Tensor]:
    with block_as_driven(stream, index, {}):
        return stream.run_block(index, hidden)


def _heads_kl(streams: tuple[BlockStream, BlockStream], finals: list[list[torch.Tensor]]
              ) -> float:
    """The KL summed over every position, window by window in order (a window's logits over
    the vocabulary are the largest tensors here)."""
    base, quant = streams
    total = 0.0
    with torch.no_grad(), base.heads_held(), quant.heads_held():
        for fb, fq, ids in zip(*finals, base.chunks(), strict=True):
            for row in range(len(ids)):
                one = ids[row : row + 1]
                kl = token_kl(log_probs(base.head_logits(fb[row : row + 1], one)[0]),
                              log_probs(quant.head_logits(fq[row : row + 1], one)[0]))
                total += float(kl.double().sum())
    return total
