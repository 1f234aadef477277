"""The calibration pass, block by block: input statistics of every quantizable module, routed
tokens per expert, optionally X^T X per Linear, and each block's input hidden states (kept for
the Fisher pass) in one streamed forward over the calibration sequences."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dynquant.pipeline.block_stream import ActivationStore, BlockStream
from dynquant.pipeline.calibration import InputStatistics
from dynquant.pipeline.progress import StageProgress


@dataclass
class CalibrationPass:
    stream: BlockStream
    stats: dict[str, torch.Tensor]
    inputs: ActivationStore  # block i's input at index i; the last block's output at index L

    def close(self) -> None:
        self.inputs.close()


def run_calibration_pass(stream: BlockStream, modules: set[str],
                         moments_dir: Path | None = None, progress: bool = False,
                         activation_limit: int = 8 << 20) -> CalibrationPass:
    """Stream the calibration ``ids`` through every block once. ``moments_dir``: write each
    block's X^T X / tokens there (``block_NNN.safetensors``, module -> [in, in])."""
    stats = InputStatistics(stream.model, modules, second_moments=moments_dir is not None)
    store = ActivationStore(activation_limit)
    hidden = stream.record()
    try:
        with StageProgress(enabled=progress) as bar:
            task = bar.add_task("calibration pass", total=len(stream.blocks))
            for i, block in enumerate(stream.blocks):
                store.put(i, hidden)
                stream.materialize(block, stream.block_prefix(i))
                try:
                    hidden = stream.run_block(i, hidden)
                finally:
                    stream.release(block)
                if moments_dir is not None:
                    _save_moments(stats, moments_dir / f"block_{i:03d}.safetensors")
                bar.advance(task)
        store.put(len(stream.blocks), hidden)
    except BaseException:
        store.close()
        raise
    finally:
        stats.remove()
    return CalibrationPass(stream, stats.result(), store)


def _save_moments(stats: InputStatistics, path: Path) -> None:
    """This block's X^T X, then dropped from memory (modules that read the same input, like
    q/k/v, are stored once each: safetensors refuses shared storage)."""
    moments = {k: v.clone() for k, v in stats.second_moments().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(moments, str(path), metadata={"format": "dynquant-second-moments"})
    stats.moments.clear()
