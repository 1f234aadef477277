"""A model run one decoder block at a time, each block's weights read from disk when it runs.

The model is a skeleton (parameters on the meta device, buffers real). What a block needs besides
its input hidden states (attention masks, rotary tables, the hybrid model's rope) does not depend
on those states, so it is recorded once per chunk of sequences by running the model with every
block replaced by a recorder that passes its input through. Then each block in turn: its
parameters are read from the model's safetensors, every chunk of hidden states runs through it,
and it goes back to meta. Peak memory: one block, plus the hidden states (kept in memory, or on
disk past a limit, see ActivationStore).

This is how GPTQModel and llm-compressor calibrate models larger than memory; here it serves
the statistics of the calibration pass and the Fisher sensitivities (``pipeline/calibrate/fisher.py``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dynquant.errors import ModelError
from dynquant.format.planner import TensorSpec
from dynquant.models.sources import ModelSource
from dynquant.numerics.gram import GramAccumulator
from dynquant.pipeline.calibrate.weights import WeightSource
from dynquant.runtime.loader import empty_model


class _Stop(Exception):
    """Raised by the last recorder: nothing after the blocks needs to run."""


class _Stand(nn.Module):
    """Stands in for a block: records its extra arguments and passes the hidden states through
    (or, as the last block, stops the run or hands back given final hidden states)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[tuple, dict]] = []
        self.stop = False
        self.output: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, *args, **kwargs):
        self.calls.append((hidden, args, kwargs))
        if self.stop:
            raise _Stop
        return hidden if self.output is None else self.output

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # what the model's loop reads off a block (attention_type, ...)
            return getattr(self._modules["inner"], name)


class _RowLookup(nn.Module):
    """An embedding table of which only rows ``ids`` exist (``rows``, in the compute dtype)."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.rows = rows
        self.index = torch.full((vocab,), -1, dtype=torch.long)
        self.index[ids] = torch.arange(len(ids))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[self.index[ids]]


class _ZeroEmbedding(nn.Module):
    """The input embedding when only what comes after the blocks is wanted."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width)


def _blocks(model: nn.Module) -> nn.ModuleList:
    count = model.config.num_hidden_layers
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ModelError("cannot find the model's decoder blocks", field="num_hidden_layers")


def first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple | list) else out


class ActivationStore:
    """Hidden states per block input: in memory up to ``limit_bytes``, then in safetensors files
    of a temporary folder (float32 either way: the statistics are sums of squares), made in
    ``directory`` where given (a measure's partial folder, which its rerun clears after a
    kill; the system's temp dir would keep a killed run's files: 1.7 GB at 7B shapes)."""

    def __init__(self, limit_bytes: int = 8 << 20, directory: Path | None = None) -> None:
        self.limit, self.used = limit_bytes, 0
        self.directory = directory
        self.memory: dict[int, list[torch.Tensor]] = {}
        self.tmp: tempfile.TemporaryDirectory | None = None

    def put(self, index: int, chunks: list[torch.Tensor]) -> None:
        size = sum(c.numel() * c.element_size() for c in chunks)
        if self.used + size <= self.limit:
            self.memory[index], self.used = chunks, self.used + size
            return
        if self.tmp is None:
            self.tmp = tempfile.TemporaryDirectory(prefix=".dynquant-acts-",
                                                   dir=self.directory)
        save_file({str(i): c.contiguous() for i, c in enumerate(chunks)}, self._file(index))

    def get(self, index: int) -> list[torch.Tensor]:
        if index in self.memory:
            return self.memory[index]
        data = load_file(self._file(index))
        return [data[str(i)] for i in range(len(data))]

    def _file(self, index: int) -> str:
        assert self.tmp is not None
        return str(Path(self.tmp.name) / f"{index:05d}.safetensors")

    def close(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


@dataclass
class BlockStream:
    """A model's skeleton and where its weights come from; calibration ``ids`` in chunks."""

    source: ModelSource
    weights: WeightSource
    ids: torch.Tensor  # [sequences, length]
    chunk: int = 8  # sequences through a block at once
    dtype: torch.dtype = torch.float32
    model: nn.Module = field(init=False)
    blocks: nn.ModuleList = field(init=False)
    calls: list[list[tuple]] = field(init=False)  # per block, per chunk: (args, kwargs)

    def __post_init__(self) -> None:
        self.model = empty_model(self.source.config, self.dtype).eval()
        self.blocks = _blocks(self.model)
        self.specs: dict[str, TensorSpec] = {s.name: s for s in self.source.tensor_specs()}
        self.tied = {f"{k}.weight": f"{v}.weight" for k, v in self.source.tied.items()}

    def chunks(self) -> Iterator[torch.Tensor]:
        yield from self.ids.split(self.chunk)

    # -- weights in and out -------------------------------------------------------------------
    def materialize(self, module: nn.Module, prefix: str, grad: set[str] = frozenset()) -> None:
        """Read ``module``'s parameters (full names ``prefix.NAME``) from disk; those in
        ``grad`` require gradients."""
        for name, owner, leaf in parameter_slots(module):
            full = f"{prefix}.{name}" if prefix else name
            stored = self.tied.get(full, full)
            if stored not in self.specs:
                raise ModelError("parameter not in the model's tensors", module=full)
            value = self.weights.get(self.specs[stored], self.dtype)
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=full in grad)

    def release(self, module: nn.Module) -> None:
        for _, owner, leaf in parameter_slots(module):
            p = owner._parameters[leaf]
            owner._parameters[leaf] = nn.Parameter(p.detach().to("meta"), requires_grad=False)

    def block_prefix(self, index: int) -> str:
        return self.module_name(self.blocks[index])

    def module_name(self, module: nn.Module) -> str:
        return next(n for n, m in self.model.named_modules() if m is module)

    # -- the runs ------------------------------------------------------------------------------
    def record(self) -> list[torch.Tensor]:
        """Each chunk's input to the first block; records every block's extra arguments."""
        embed = self.model.get_input_embeddings()
        stands = self._stand_in()
        stands[-1].stop = True
        lookup = self._row_lookup(embed)
        if lookup is not None:
            self.model.set_input_embeddings(lookup)
        else:
            self.materialize(embed, self.module_name(embed))
        first: list[torch.Tensor] = []
        try:
            with torch.no_grad():
                for ids in self.chunks():
                    with contextlib.suppress(_Stop):
                        self.model(input_ids=ids, use_cache=False)
                    first.append(stands[0].calls[-1][0].float())
        finally:
            if lookup is not None:
                self.model.set_input_embeddings(embed)
            else:
                self.release(embed)
            self._put_back(stands)
        self.calls = [[(a, k) for _, a, k in s.calls] for s in stands]
        return first

    def _row_lookup(self, embed: nn.Module) -> nn.Module | None:
        """A plain embedding (a lookup that copies rows) stood in for by just the rows the
        calibration ids use, read from the file: not the whole table (the largest tensor of
        most models). None for anything else (scaled embeddings compute in their dtype)."""
        if type(embed) is not nn.Embedding:
            return None
        name = f"{self.module_name(embed)}.weight"
        used = torch.unique(self.ids)
        rows = self.weights.get_rows(self.specs[self.tied.get(name, name)], used, self.dtype)
        return _RowLookup(used, rows, embed.num_embeddings)

    def run_block(self, index: int, hidden: list[torch.Tensor],
                  recorded: list[tuple] | None = None) -> list[torch.Tensor]:
        """The block's outputs for every chunk (its weights must be materialized); ``recorded``:
        the chunks' (args, kwargs) when not this stream's own (a worker's shard)."""
        block = self.blocks[index]
        out = []
        with torch.no_grad():
            for h, (args, kwargs) in zip(hidden, recorded or self.calls[index], strict=True):
                out.append(first_output(block(h.to(self.dtype), *args, **kwargs)).float())
        return out

    def head_logits(self, final: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The model's logits given the last block's outputs ``final`` for ``ids``: whatever the
        model does after its blocks (final norm, lm_head, soft-capping) runs as written; the
        embedding and the blocks are stood in for (``final`` taken in the stream's dtype). Head
        weights must be materialized."""
        embed = self.model.get_input_embeddings()
        stands = self._stand_in()
        stands[-1].output = final.to(self.dtype)
        self.model.set_input_embeddings(_ZeroEmbedding(final.shape[-1]))
        try:
            return self.model(input_ids=ids, use_cache=False).logits
        finally:
            self.model.set_input_embeddings(embed)
            self._put_back(stands)

    def head_inputs(self, linear: nn.Module, finals: list[torch.Tensor],
                    ids: list[torch.Tensor], seen: Callable[[torch.Tensor], None]) -> None:
        """Each of ``finals``' inputs to the head Linear ``linear`` handed to ``seen``: the model's
        final norm runs, the vocabulary-wide product does not (head weights materialized)."""
        def stop(_module: nn.Module, inputs: tuple) -> None:
            seen(inputs[0])
            raise InputSeen

        handle = linear.register_forward_pre_hook(stop)
        try:
            with torch.no_grad():
                for final, row in zip(finals, ids, strict=True):
                    with contextlib.suppress(InputSeen):
                        self.head_logits(final, row)
        finally:
            handle.remove()

    @contextmanager
    def heads_held(self) -> Iterator[list[tuple[str, nn.Module]]]:
        """The head modules (``head_modules``) materialized, released after."""
        parts = self.head_modules()
        for name, module in parts:
            self.materialize(module, name)
        try:
            yield parts
        finally:
            for _, module in parts:
                self.release(module)

    def head_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules with parameters outside the blocks and the input embedding."""
        embed = self.model.get_input_embeddings()
        inside = {id(m) for b in self.blocks for m in b.modules()} | {id(embed)}
        out = []
        for name, module in self.model.named_modules():
            if id(module) in inside or not list(module.parameters(recurse=False)):
                continue
            out.append((name, module))
        return out

    def _stand_in(self) -> list[_Stand]:
        stands = [_Stand(b) for b in self.blocks]
        for i, s in enumerate(stands):
            self.blocks[i] = s
        return stands

    def _put_back(self, stands: list[_Stand]) -> None:
        for i, s in enumerate(stands):
            self.blocks[i] = s.inner


class InputSeen(Exception):
    """Raised by a hook once the input it wanted has been seen: the rest of the forward is not
    needed (the caller suppresses it)."""


class InputMoments(GramAccumulator):
    """X^T X of a module's input, summed by a forward pre-hook that then stops the forward
    (nothing after the module is needed)."""

    def hook(self, _module: nn.Module, inputs: tuple) -> None:
        self.add(inputs[0])
        raise InputSeen


def parameter_slots(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name relative to ``module``, owning submodule, attribute) of every parameter."""
    return [(f"{mod_name}.{leaf}" if mod_name else leaf, owner, leaf)
            for mod_name, owner in module.named_modules()
            for leaf in list(owner._parameters) if owner._parameters[leaf] is not None]
