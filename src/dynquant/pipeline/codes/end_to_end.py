"""Group scales and offsets tuned end to end (``quantize --e2e-steps N``): every quantized
tensor's codes frozen, their scales and offsets moved together to lower the whole model's KL
to the float model on the calibration windows (EfficientQAT's E2E-QP, in the format's terms:
``numerics/tuned_scales.py``).

The float model's next-token distributions are computed first: its head on its last block's
outputs, which the sequential pass of tuned codes has already made (the tuning's targets), else
its blocks run first, one in memory at a time (``BlockStream``). They are kept as each
position's ``top_k`` most likely tokens' log-probabilities
and the rest's total: the loss is the KL between those ``top_k + 1`` bins (the vocabulary-wide
KL's lower bound, equal to it where the float model's rest is spread as the quantized model's
is). Each step runs one window through the quantized model, its every quantized weight
dequantized from codes and tunable scales; where the blocks' dequantized weights pass
``HELD_WEIGHTS_BYTES`` each block runs under activation checkpointing. The codes stay in the
resume folder's files and are read where a step uses them (``TunableScales(codes=...)``): what
the pass holds is each tensor's groups (their two factors, the factors' gradients and Adam's
moments, the start's bf16 scale and offset: ~36 bytes a group), the model's dense tensors, and
one block's dequantized weights while it runs forward or backward; the embedding is
dequantized at the rows a window looks up and the head a chunk of rows at a time
(``numerics/tunable_rows.py``), never whole. A tied embedding's two uses (the lookup and the
head) read the same tunable scales and both give them gradients. Adam, one window a step in
a seeded order, the step size falling linearly to zero (as the block-wise tuning,
``tuned_scales.py``).
An eighth of the windows is kept out of the tuning: the tuned scales are kept only where they
lower the KL there (a step size too large fits the tuned windows and loses on others:
BENCHMARKS.md "Tuned scales").

The tuned codes are written into the quantization's resume folder as one file before they
replace the stored ones: a killed run either tunes again from the same codes or finds the file
and only puts it in place (the same bytes either way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from dynquant.checkpoint.resume import ResumeStore
from dynquant.format.planner import TensorSpec
from dynquant.freed_memory import reusing_freed_memory
from dynquant.numerics.tunable_rows import tunable_product, tunable_rows
from dynquant.numerics.tuned_scales import TunableScales
from dynquant.pipeline.calibrate.block_stream import BlockStream, first_output
from dynquant.pipeline.execute.progress import StageProgress

TUNED_FILE = "end_to_end.safetensors"
# Dequantized weights held for the backward up to this size (float32); past it each block is
# checkpointed (run again in the backward: about a third more time a step, one block's weights)
HELD_WEIGHTS_BYTES = 1 << 30
# The default for tuned codes: steps, and the most quantized weights it is run for. Memory does
# not bound it (the pass holds ~36 bytes a group besides one block's weights); time does: the
# pass costs a quarter to a third of the rest of the quantize, which keeps tuned codes within 3x
# GPTQ's quantize on the models measured (135-585 M weights) but, by the calibrated cost model,
# only just at 8 B (2.9-3.25x against 2.2-2.4x without it, by two runs' rates:
# docs/distributed.md); past the bound it is opt-in.
AUTO_STEPS = 40
AUTO_MAX_WEIGHTS = 2_000_000_000
# Adam's step (3-bit codes). Its first steps move every group at once and lift the KL before it
# falls; at twice this step SmolLM2-135M's held-out KL never came back below its start, while
# Gemma-3-270M gains a little more there: this is the step that lowers both (BENCHMARKS.md
# "Tuned scales").
LR = 5e-4


@dataclass(frozen=True)
class EndToEndTuning:
    """How the whole model's scales are tuned (part of the codes' identity)."""

    # one calibration window each; 0: no end-to-end tuning; None: ``resolved``'s default
    steps: int | None = None
    lr: float = LR  # Adam's step for 3-bit codes, ``lr * 7 / max_code`` at other widths
    top_k: int = 128  # the float model's most likely tokens kept per position
    seed: int = 0

    def resolved(self, quantizer: str, quantized_weights: int) -> EndToEndTuning:
        """These settings with ``steps`` decided: as given, else ``AUTO_STEPS`` for tuned codes
        of a model with at most ``AUTO_MAX_WEIGHTS`` quantized weights, else 0 (gptq's codes
        are left as GPTQ makes them unless steps are asked for)."""
        if self.steps is not None:
            return self
        auto = quantizer == "tuned" and quantized_weights <= AUTO_MAX_WEIGHTS
        return replace(self, steps=AUTO_STEPS if auto else 0)


@dataclass
class Teacher:
    """The float model's distribution at every position of one window, in ``top_k + 1`` bins."""

    log_probs: torch.Tensor  # [positions, top_k]
    tokens: torch.Tensor  # [positions, top_k]
    rest: torch.Tensor  # [positions]: log of the other tokens' total probability


def log_rest(log_probs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(log_probs))) over the last dimension (the bins' remainder)."""
    total = torch.logsumexp(log_probs, -1).clamp(max=-1e-7)
    return torch.log(-torch.expm1(total))


def binned_kl(teacher: Teacher, logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || model) between the teacher's bins, ``logits``
    [positions, vocabulary] the model's."""
    log_q = torch.log_softmax(logits.float(), -1)
    top_q = log_q.gather(-1, teacher.tokens)
    p = teacher.log_probs.exp()
    kl = (p * (teacher.log_probs - top_q)).sum(-1)
    kl = kl + teacher.rest.exp() * (teacher.rest - log_rest(top_q))
    return kl.mean()


def teacher_of(stream: BlockStream, first: list[torch.Tensor], top_k: int,
               say: Callable[[str], None], finals: list[torch.Tensor] | None = None
               ) -> list[Teacher]:
    """The float model's bins for each of the stream's windows (chunks of one sequence), from
    ``first``, their inputs to the first block (``stream.record()``), through every block; or
    from ``finals``, the last block's outputs, where the caller has them (the sequential pass
    runs the float model for its tuning: the same bits)."""
    hidden = first if finals is None else finals
    for b, block in enumerate(stream.blocks if finals is None else []):
        say(f"float model, block {b + 1}/{len(stream.blocks)}")
        stream.materialize(block, stream.block_prefix(b))
        hidden = stream.run_block(b, hidden)
        stream.release(block)
    out = []
    with stream.heads_held(), torch.no_grad():
        for final, ids in zip(hidden, stream.chunks(), strict=True):
            logp = torch.log_softmax(stream.head_logits(final.to(stream.dtype), ids)
                                     .float()[0], -1)
            top, tokens = logp.topk(min(top_k, logp.shape[-1]), -1)
            out.append(Teacher(top, tokens, log_rest(top)))
    return out


class _Head(nn.Module):
    """What runs after the blocks, as a module whose parameters ``functional_call`` can
    replace (the head's weight by its tunable codes)."""

    def __init__(self, stream: BlockStream) -> None:
        super().__init__()
        self.model = stream.model
        self.stream = stream

    def forward(self, final: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.stream.head_logits(final, ids)


class _TunableHead(nn.Module):
    """The head Linear's stand-in while the student runs: its product a chunk of rows at a
    time (``tunable_product``), its bias (if any) as it was."""

    def __init__(self, tunable: TunableScales, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = (tunable, bias)  # (a tuple: not registered, not replaced by functional_call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tunable, bias = self.parts
        y = tunable_product(x, tunable)
        return y if bias is None else y + bias


class _Student:
    """The quantized model: dense tensors in memory, each quantized one as tunable scales whose
    codes are read from the resume folder where they are used (by full parameter name; a tied
    head's name maps to the embedding's). ``first``: the windows' inputs to the first block
    with the float embedding, what a dense embedding gives. The embedding is dequantized only
    at the rows a window looks up, the head a chunk of rows at a time (``tunable_rows``)."""

    def __init__(self, stream: BlockStream, tunables: dict[str, TunableScales],
                 first: list[torch.Tensor]) -> None:
        self.stream = stream
        self.tunables = tunables
        self.embed = stream.model.get_input_embeddings()
        self.embed_name = f"{stream.module_name(self.embed)}.weight"
        self.head = _Head(stream)
        self.prefixes = [stream.block_prefix(b) + "." for b in range(len(stream.blocks))]
        for b, block in enumerate(stream.blocks):
            self._hold(block, self.prefixes[b][:-1])
        for name, module in stream.head_modules():
            self._hold(module, name)
        self.first = None if self._stored(self.embed_name) in self.tunables else first
        linear = stream.model.get_output_embeddings()
        self.head_name = f"{stream.module_name(linear)}."
        head = self.tunables.get(self._stored(f"{self.head_name}weight"))
        self.tunable_head = None if head is None else _TunableHead(head, linear.bias)
        # (the blocks' alone: the embedding's and the head's are never made whole, and a
        # checkpointed block costs a second forward)
        in_blocks = {self._stored(f"{prefix}{name}")
                     for prefix, block in zip(self.prefixes, stream.blocks, strict=True)
                     for name, _ in block.named_parameters()}
        weights = sum(math.prod(t.shape) for name, t in self.tunables.items()
                      if name in in_blocks) * 4
        self.checkpointed = weights > HELD_WEIGHTS_BYTES

    def _stored(self, name: str) -> str:
        return self.stream.tied.get(name, name)

    def _hold(self, module: nn.Module, prefix: str) -> None:
        """``module``'s dense parameters read from disk; its quantized ones left on meta (the
        tunables stand in for them)."""
        self.stream.materialize(module, prefix)
        for name, param in list(module.named_parameters()):
            if self._stored(f"{prefix}.{name}") in self.tunables:
                owner, _, leaf = name.rpartition(".")
                target = module.get_submodule(owner) if owner else module
                target._parameters[leaf] = nn.Parameter(param.detach().to("meta"),
                                                        requires_grad=False)

    def _weights(self, prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's quantized parameters (names relative to it) from their tunables."""
        out = {}
        for name, param in module.named_parameters():
            stored = self._stored(f"{prefix}{name}")
            if stored in self.tunables:
                out[name] = self.tunables[stored]().reshape(param.shape)
        return out

    def logits(self, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Window ``k``'s logits (``ids`` its tokens), differentiable in every tunable."""
        stream = self.stream
        hidden = self._lookup(ids) if self.first is None else self.first[k]
        for b in range(len(stream.blocks)):
            args, kwargs = stream.calls[b][k]
            if self.checkpointed:
                hidden = checkpoint(self._block_forward, b, hidden.to(stream.dtype), args,
                                    kwargs, use_reentrant=False)
            else:
                hidden = self._block_forward(b, hidden.to(stream.dtype), args, kwargs)
        head = {f"model.{n}": w for n, w in self._head_weights().items()}
        with self._head_standing_in():
            return functional_call(self.head, head, (hidden, ids))[0]

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The quantized embedding's output for ``ids``: a lookup in just the rows they use
        (the padding row, if used, still the padding row), other embeddings on the whole."""
        tunable = self.tunables[self._stored(self.embed_name)]
        if not isinstance(self.embed, nn.Embedding):
            weight = tunable().reshape(self.embed.weight.shape)
            return functional_call(self.embed, {"weight": weight}, (ids,))
        used, local = torch.unique(ids, return_inverse=True)
        padding = self.embed.padding_idx
        at = torch.nonzero(used == padding).flatten().tolist() if padding is not None else []
        self.embed.padding_idx = at[0] if at else None
        try:
            return functional_call(self.embed, {"weight": tunable_rows(used, tunable)},
                                   (local,))
        finally:
            self.embed.padding_idx = padding

    @contextmanager
    def _head_standing_in(self) -> Iterator[None]:
        if self.tunable_head is None:
            yield
            return
        model = self.stream.model
        linear = model.get_output_embeddings()
        model.set_output_embeddings(self.tunable_head)
        try:
            yield
        finally:
            model.set_output_embeddings(linear)

    def _head_weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for prefix, module in self.stream.head_modules():
            if self.tunable_head is not None and f"{prefix}." == self.head_name:
                continue
            for name, w in self._weights(f"{prefix}.", module).items():
                out[f"{prefix}.{name}"] = w
        return out

    def _block_forward(self, b: int, hidden: torch.Tensor, args: tuple, kwargs: dict
                       ) -> torch.Tensor:
        block = self.stream.blocks[b]
        weights = self._weights(self.prefixes[b], block)
        return first_output(functional_call(block, weights, (hidden, *args), kwargs))


def tune_end_to_end(stream: BlockStream, tunables: dict[str, TunableScales],
                    tuning: EndToEndTuning, progress: bool = False,
                    finals: list[torch.Tensor] | None = None) -> bool:
    """``tunables`` (by the tensor's stored name) tuned against the float model's distributions
    on the stream's windows (chunks of one sequence; ``finals``: its last block's outputs on
    them, where the caller has them); whether the tuned ones are kept: not where they do worse
    than the codes as they were on the windows held out of the tuning."""
    with StageProgress(enabled=progress) as bar:
        task = bar.add_task("end-to-end scales", total=tuning.steps + 2)
        first = stream.record()  # also records every block's extra arguments
        teachers = teacher_of(stream, first, tuning.top_k, lambda what: bar.note(task, what),
                              finals)
        student = _Student(stream, tunables, first)
        windows = list(stream.chunks())
        held = list(range(len(windows) - validation_windows(len(windows)), len(windows)))
        before = _held_out_kl(student, teachers, windows, held)
        bar.advance(task)
        _fit(student, teachers, windows, len(windows) - len(held), tuning,
             lambda loss: (bar.note(task, f"KL {loss:.4f}"), bar.advance(task)))
        after = _held_out_kl(student, teachers, windows, held)
        keep = not held or after < before
        bar.advance(task, note=f"held-out KL {before:.4f} -> {after:.4f}: "
                               f"{'tuned scales kept' if keep else 'the codes as they were kept'}")
        return keep


def validation_windows(count: int) -> int:
    """Windows kept out of the tuning to check it (an eighth; none of a single window)."""
    return count // 8 if count >= 8 else min(1, count - 1)


def _held_out_kl(student: _Student, teachers: list[Teacher], windows: list[torch.Tensor],
                 held: list[int]) -> float:
    """The mean binned KL over windows ``held`` (0 with none)."""
    with torch.no_grad():
        return sum(float(binned_kl(teachers[k], student.logits(k, windows[k])))
                   for k in held) / max(1, len(held))


def _fit(student: _Student, teachers: list[Teacher], windows: list[torch.Tensor], fitted: int,
         tuning: EndToEndTuning, say: Callable[[float], None]) -> None:
    """Adam on every tunable, one of the first ``fitted`` windows a step in a seeded order."""
    params = [{"params": list(t.parameters()), "width": 7 / t.max_code}
              for t in student.tunables.values()]
    opt = torch.optim.Adam(params, lr=tuning.lr)
    gen = torch.Generator().manual_seed(tuning.seed)
    order = torch.randint(fitted, (tuning.steps,), generator=gen).tolist()
    with reusing_freed_memory():  # each step frees and makes the same large tensors
        for step, k in enumerate(order):
            for group in opt.param_groups:
                group["lr"] = tuning.lr * group["width"] * (1 - step / tuning.steps)
            loss = binned_kl(teachers[k], student.logits(k, windows[k]))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            say(float(loss.detach()))


def end_to_end_codes(stream: BlockStream, specs: list[TensorSpec], quantized: set[str],
                     store: ResumeStore, tuning: EndToEndTuning, progress: bool = False,
                     finals: list[torch.Tensor] | None = None) -> None:
    """Every quantized tensor in ``store`` given its end-to-end tuned scales and offsets (tuned
    now, or read from the resume folder's file of an earlier run). The codes stay in the
    store's files, read where they are used: what the pass holds of a tensor is its groups'.
    ``finals``: the float model's last block's outputs on the stream's windows, if known."""
    index = {s.name: i for i, s in enumerate(specs) if s.module in quantized}
    tuned = store.read_tensors(TUNED_FILE)
    if tuned is None:
        tunables = {name: _stored_tunable(store, i) for name, i in index.items()}
        keep = tune_end_to_end(stream, tunables, tuning, progress, finals)
        tuned = {}
        for name, t in tunables.items():
            s, o = t.scale_offset() if keep else (t.start.scales, t.start.offsets)
            tuned[f"{index[name]}.scales"] = s.detach().to(torch.bfloat16)
            tuned[f"{index[name]}.offsets"] = o.detach().to(torch.bfloat16)
        store.write_tensors(TUNED_FILE, tuned)
    for i in index.values():
        store.save_quantized(i, specs[i].module, replace(
            store.quantized(i), scales=tuned[f"{i}.scales"], offsets=tuned[f"{i}.offsets"]))


def _stored_tunable(store: ResumeStore, index: int) -> TunableScales:
    """Tensor ``index``'s tunable scales, its codes read from the store each time they are
    used (its ``start`` holds them as a meta tensor)."""
    _, _, meta, loaders = store.load(index)
    qname, sname, oname = loaders
    start = replace(meta, scales=store.tensor(index, sname), offsets=store.tensor(index, oname))
    return TunableScales(start, codes=lambda: store.tensor(index, qname))
