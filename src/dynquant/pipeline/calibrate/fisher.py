"""Sensitivities from one streamed backward pass: a Fisher estimate of each module's KL.

For a small weight change dW, the mean KL(base || perturbed) of the next-token distribution is
0.5 dW^T F dW / tokens, F the Fisher information of the model's own predictions summed over the
calibration tokens (quadratic in dW: checked on the reference models down to a quarter of the
3-bit error). With G the gradient of sum_t log p(y_t) for labels y_t drawn from the model itself,
E[(G . dW)^2] = dW^T F dW exactly: the scores of different tokens have zero mean and are
independent given the inputs, so their cross terms vanish. So each module's estimate is the mean
of (G_s . dW)^2 over sequences s and label draws, one backward per draw.

F's diagonal alone (sum F_ii dW_i^2, what one would get from squared gradients) is not enough:
quantization errors are not independent of the weights (the clip search shrinks each group
along its own weights), and the diagonal estimate came out 1.5-4x low on the reference models.

The backward runs block by block from the top, recomputing each block from its stored input
(``calibration_pass.py``): one block in memory, and no gradient is kept past its dot product with
the module's error. A block's sequences run as jobs on the executor: all of them in one job here,
``CLUSTER_SHARD_SEQS`` a job on Ray workers, each job with its sequences' gradients and the
block's probe-width codes (made once, on the driver, and shared by the block's jobs). Every
sequence's products are its own (G_s . dW, one per draw), so the estimate is the same bits however
the sequences were split. The head's backward, whose labels are drawn in one seeded order, runs
on the driver.

The probe (``measure.KLProbe``, ``--method kl-exact``) measures the same KL with one full forward
per module; the tests and benchmarks/ hold this estimate to it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dynquant.format.planner import TensorSpec
from dynquant.models.embedding_scale import embedding_scale
from dynquant.numerics.gram import GramAccumulator
from dynquant.numerics.quantizer import QuantizedTensor, dequantize_rows
from dynquant.pipeline.calibrate.block_stream import (
    BlockStream,
    first_output,
    parameter_slots,
)
from dynquant.pipeline.calibrate.calibration_pass import (
    BlockShard,
    BlockWork,
    CalibrationPass,
    block_as_driven,
    serving,
    shard_stream,
    shards_of,
)
from dynquant.pipeline.calibrate.weights import WeightsAt
from dynquant.pipeline.execute.executor import Executor, LocalExecutor, use_threads
from dynquant.pipeline.execute.heap import heap_served
from dynquant.pipeline.execute.progress import StageProgress

# module's spec, its float32 weight -> the module quantized at the probe width
ProbeWeight = Callable[[TensorSpec, torch.Tensor], QuantizedTensor]
# an output head's or input embedding's spec, float32 weight and (for a head) its inputs' second
# moments -> its codes at every width it may get, by name, one at a time (codes None: still
# working, a heartbeat for the progress line): measured in the pass
Variants = Callable[[TensorSpec, torch.Tensor, torch.Tensor | None],
                    Iterator[tuple[str, QuantizedTensor | None]]]
ROWS_CHUNK = 1 << 20  # elements dequantized at once
# elements of a block Linear's error dequantized at once for its product with a sequence's
# inputs (32 MiB of float32 a chunk): wide products, near the BLAS's rate (chunks of
# ROWS_CHUNK: the blocks' backward at a 7B layer's shapes 9% slower)
TAP_CHUNK = 1 << 23
DENSE_ERROR_MAX = 1 << 21  # elements: errors of modules up to this size are kept in bf16
HEAD_LOGITS = 1 << 24  # logits computed at once (positions x vocabulary): 64 MiB
# the head's logits recomputed in float32 match the model's within this share of their range
# (bf16 compute rounds them), else the model does more after its head than T(x W^T + b)
HEAD_MATCH = 0.05
# sequences per job of a block's backward on a cluster: one sequence's backward at a 7B layer's
# shapes is seconds of work (at 70B's ~30 s on 2 cores), against a block's weights read by the
# worker once per job (1.7 GB at 70B: a second or two); one a job spreads a block the widest
CLUSTER_SHARD_SEQS = 1


class ModuleError:
    """A module's error at the probe width, kept as its quantized codes (about 3.25 bits a
    weight) beside the weight itself, not as a float copy: rows are dequantized a chunk at a
    time when a gradient arrives, and the weight subtracted."""

    def __init__(self, qt: QuantizedTensor, weight: torch.Tensor, stored_dtype: str) -> None:
        lay = qt.layout
        self.qt, self.weight = qt, weight.reshape(lay.num_rows, lay.in_features)
        self.stored_dtype = stored_dtype
        self.dense: torch.Tensor | None = None
        # A small module's error is dequantized once, in bf16 (a few MiB): its every
        # gradient would otherwise dequantize it again (40% of the pass on a 135 M model).
        self.dense = (self.rows(slice(None)).to(torch.bfloat16)
                      if lay.num_rows * lay.in_features <= DENSE_ERROR_MAX else None)
        self._dense32: torch.Tensor | None = None
        self._bf16: torch.Tensor | None = None

    def keep_as_stored(self, stored: dict[int, torch.Tensor]) -> None:
        """Hold the weight in its stored 16-bit dtype (exact: it was read from it) once its
        float32 copy is no longer in the model: the tied embedding's, from the head to the
        bottom of the pass. ``stored``: the copies made so far, by the float32 weight's
        storage, which a module's width variants share (one copy, not one each)."""
        if self.stored_dtype in ("bfloat16", "float16"):
            key = self.weight.data_ptr()
            if key not in stored:
                stored[key] = self.weight.to(getattr(torch, self.stored_dtype))
            self.weight = stored[key]

    def dense_float(self) -> torch.Tensor:
        """The bf16 error as float32, made once: a block module's taps read it for every
        calibration sequence (SmolLM2: 2.2 s of a 30 s measure converting it again each time).
        Block modules' errors live while their block runs; the copy goes with them."""
        if self._dense32 is None:
            self._dense32 = self.dense.float()
        return self._dense32

    def bf16(self) -> torch.Tensor:
        """The whole error rounded to bf16, made once, a chunk of rows at a time (the same bits
        as each chunk's float32 error rounded): a bf16 pass's taps multiply it by every
        sequence's inputs, where dequantizing it again for each took a third of the Fisher
        pass's blocks at 7B shapes. Held as long as the error (a block's: 2 bytes a weight)."""
        if self.dense is not None:
            return self.dense
        if self._bf16 is None:
            rows, cols = self.weight.shape
            out = torch.empty(rows, cols, dtype=torch.bfloat16)
            step = max(1, ROWS_CHUNK // cols)
            for r in range(0, rows, step):
                out[r : r + step] = self.rows(slice(r, min(r + step, rows)))
            self._bf16 = out
        return self._bf16

    def rows(self, index: torch.Tensor | slice) -> torch.Tensor:
        """The error of rows ``index`` (float32)."""
        if self.dense is not None:
            return self.dense_float()[index]
        lay = self.qt.layout
        w_hat = dequantize_rows(self.qt.qweight[index], self.qt.scales[index],
                                self.qt.offsets[index], lay.bits, lay.group_size,
                                lay.in_features, torch.float32)
        return w_hat.sub_(self.weight[index].float())

    def dot(self, grad: torch.Tensor) -> torch.Tensor:
        """sum(grad * error): at once for a small module, else a chunk of rows at a time."""
        g = grad.reshape(self.weight.shape)
        if self.dense is not None:
            return torch.dot(g.reshape(-1).float(), self.dense_float().reshape(-1)).double()
        step = max(1, ROWS_CHUNK // self.weight.shape[1])
        total = torch.zeros((), dtype=torch.float64)
        for r in range(0, g.shape[0], step):
            rows = slice(r, min(r + step, g.shape[0]))
            total += torch.dot(g[rows].reshape(-1), self.rows(rows).reshape(-1)).double()
        return total


# A product's key plus this: the input embedding's lookup use, squared apart from a tied
# embedding's head use. Their cross term is small in the KL it prices (Gemma-3-270M's
# embedding at 4 bits, only it quantized: the two uses' KLs sum to within 2-3% of both's),
# and with a few sequences and draws its estimate is the noisiest part of the product
# (BENCHMARKS.md "Tuned scales").
LOOKUP_USE = "#lookup"


class _Accumulator:
    """Per module, G . dW for every (sequence, label draw), fed by gradient hooks; an input
    embedding's lookup use under its own key (``LOOKUP_USE``), its KL added to the head use's."""

    def __init__(self, sequences: int, draws: int) -> None:
        self.shape = (sequences, draws)
        self.errors: dict[str, ModuleError] = {}
        self.products: dict[str, torch.Tensor] = {}
        self.at = (0, 0)  # the (sequence, draw) whose backward is running
        self.hooks = []

    def watch(self, param: nn.Parameter, module: str) -> None:
        def fn(p: torch.Tensor) -> None:
            self.add(module, self.errors[module].dot(p.grad))
            p.grad = None  # one gradient alive at a time
        self.hooks.append(param.register_post_accumulate_grad_hook(fn))

    def add(self, module: str, value: torch.Tensor) -> None:
        if module not in self.products:
            self.products[module] = torch.zeros(self.shape, dtype=torch.float64)
        self.products[module][self.at] += float(value)

    def put_rows(self, first: int, products: dict[str, torch.Tensor]) -> None:
        """A shard's products (its sequences from ``first`` on, every draw) in place."""
        for key, rows in products.items():
            if key not in self.products:
                self.products[key] = torch.zeros(self.shape, dtype=torch.float64)
            self.products[key][first : first + rows.shape[0]] = rows

    def kl(self, key: str, tokens: int) -> float:
        """0.5 E[(G . dW)^2] per token of a product and of its lookup use's (0 when nothing
        was added)."""
        return sum(float(0.5 * self.products[k].square().mean(1).sum() / tokens)
                   for k in (key, key + LOOKUP_USE) if k in self.products)

    def unwatch(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def fisher_kl(cal: CalibrationPass, modules: set[str], probe_weight: ProbeWeight,
              draws: int = 2, seed: int = 0, progress: bool = False,
              variants: Variants | None = None,
              variant_kls: dict[str, dict[str, float]] | None = None,
              head_moments: dict[str, torch.Tensor] | None = None,
              executor: Executor | None = None) -> dict[str, float]:
    """Predicted mean KL per token of each module in ``modules`` at its probe-width weights
    (``probe_weight``); ``draws`` label draws per sequence (the estimate's relative noise is
    about sqrt(2 / (sequences * draws))). With ``variants``, the output head and the input
    embedding
    (most of the weights of a large-vocabulary model, and the modules whose two uses share one
    matrix) are also measured at each of their variants' codes, in the same pass (the same
    labels: differences between variants are not noise), into ``variant_kls``; a head's
    compensated variants fit ``head_moments`` (of more windows) when given, else its inputs
    here. The blocks' shards run on ``executor`` (default: this process)."""
    stream = cal.stream
    acc = _Accumulator(stream.ids.shape[0], draws)
    gen = torch.Generator().manual_seed(seed)
    executor = executor or LocalExecutor()
    work = BlockWork(WeightsAt.of(stream.source, False), stream.dtype, frozenset(modules),
                     False, torch.get_num_threads())
    with StageProgress(enabled=progress) as bar, serving(stream, work):
        with heap_served():  # the head's terms remake the same chunks of rows
            grads = _head_backward(stream, cal, modules, probe_weight, acc, gen, draws, bar,
                                   variants, head_moments)
        task = bar.add_task("Fisher pass", total=len(stream.blocks))
        per = stream.ids.shape[0] if executor.runs_here else CLUSTER_SHARD_SEQS
        for i in reversed(range(len(stream.blocks))):
            block = BlockProbes(work, _block_probes(stream, i, modules, probe_weight))
            shards = _shards(stream, i, cal.inputs.get(i), grads, per)
            grads, first = [], 0
            for products, below in executor.map(fisher_block_job, shards, block,
                                                 cpus=work.threads):
                acc.put_rows(first, products)
                first += len(below)
                grads.extend(below)
            bar.advance(task)
    _embedding_backward(stream, grads, modules, probe_weight, acc, variants)
    tokens = stream.ids.numel()
    if variant_kls is not None:
        for key in sorted({k.removesuffix(LOOKUP_USE) for k in acc.products}):
            module, _, name = key.partition("|")
            if name:
                variant_kls.setdefault(module, {})[name] = acc.kl(key, tokens)
    return {m: acc.kl(m, tokens) for m in sorted(modules)}


def _watch(stream: BlockStream, module: nn.Module, prefix: str, modules: set[str],
           probe_weight: ProbeWeight, acc: _Accumulator, hook: bool = True, grad: bool = True,
           tapped: frozenset[str] = frozenset()) -> dict[str, nn.Parameter]:
    """Materialize ``module`` with gradients on its quantizable weights and watch them (each
    gradient's product taken as it arrives; ``hook=False``: left to the caller, and with
    ``grad=False`` no weight gradients at all; parameters named in ``tapped`` get neither: their
    Linear's taps measure them). Returns module -> parameter."""
    wanted = {}
    for name, _owner, _leaf in parameter_slots(module):
        full = f"{prefix}.{name}" if prefix else name
        spec = stream.specs.get(stream.tied.get(full, full))
        if spec is not None and spec.module in modules:
            wanted[full] = spec
    stream.materialize(module, prefix, grad=set(wanted) - tapped if grad else set())
    watched = {}
    for name, owner, leaf in parameter_slots(module):
        full = f"{prefix}.{name}" if prefix else name
        if full in wanted:
            spec, param = wanted[full], owner._parameters[leaf]
            if spec.module not in acc.errors:
                w = param.detach()
                acc.errors[spec.module] = ModuleError(probe_weight(spec, w), w, spec.dtype)
            if hook and full not in tapped:
                acc.watch(param, spec.module)
            watched[spec.module] = param
    return watched


def _sample(logp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One label per row drawn from ``softmax(logp)``, [rows, 1]: the Gumbel-max trick (one
    uniform draw per logit; torch.multinomial is ~50x slower on 50k-token vocabularies)."""
    u = torch.rand(logp.shape, generator=gen).clamp_(min=1e-20)
    return (logp - u.log_().neg_().log_()).argmax(-1, keepdim=True)


def _sequences(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    return [row[None] for chunk in chunks for row in chunk]


class _LinearTaps:
    """A head Linear's input and its output's gradient, as the pass runs: with them a draw's
    <grad_W, dW> is sum(grad_out * (x @ dW^T)), and x @ dW^T is computed once per chunk of
    positions instead of a vocabulary-sized weight gradient per draw."""

    def __init__(self, linear: nn.Module) -> None:
        self.linear = linear
        self.x: torch.Tensor | None = None  # in the pass's dtype
        self.grad: torch.Tensor | None = None
        self.hook = linear.register_forward_hook(self._forward)

    def _forward(self, _module, inputs, output) -> None:
        self.x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
        output.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.grad = grad.reshape(-1, grad.shape[-1]).float()

    def times_error(self, error: ModuleError) -> torch.Tensor:
        """x @ dW^T, [positions, out] in float32, a chunk of output rows at a time (in a bf16
        pass the product of x and dW rounded to bf16, as the pass's own products are)."""
        rows = error.weight.shape[0]
        step = max(1, TAP_CHUNK // error.weight.shape[1])
        if self.x.dtype == torch.bfloat16:  # at bf16's rate, the error rounded to bf16 once
            dw = error.bf16()
            return torch.cat([(self.x @ dw[r : r + step].T).float()
                              for r in range(0, rows, step)], dim=1)
        x = self.x.float()
        return torch.cat([x @ error.rows(slice(r, min(r + step, rows))).T
                          for r in range(0, rows, step)], dim=1)


def _head_backward(stream: BlockStream, cal: CalibrationPass, modules: set[str],
                   probe_weight: ProbeWeight, acc: _Accumulator, gen: torch.Generator,
                   draws: int, bar: StageProgress, variants: Variants | None = None,
                   head_moments: dict[str, torch.Tensor] | None = None
                   ) -> list[list[torch.Tensor]]:
    """Per sequence and draw: the gradient of the sampled log-likelihood at the last block's
    outputs; the head's quantizable Linears (the lm_head, the tied embedding's use as one)
    are measured by :class:`_HeadTerms` where the logits are the Linear's output (soft-capped
    or not), else through their taps (no weight gradients either way); with the terms, each
    of their ``variants`` too (errors keyed ``MODULE|NAME``)."""
    heads = stream.head_modules()
    taps: dict[str, _LinearTaps] = {}
    terms: dict[str, _HeadTerms] = {}
    for name, module in heads:
        for key in _watch(stream, module, name, modules, probe_weight, acc, hook=False,
                          grad=False):
            taps[key] = _LinearTaps(module)
            terms[key] = _HeadTerms(module, _softcap(stream.model.config))
    grads = []
    try:
        ids = _sequences(list(stream.chunks()))
        finals = _sequences(cal.inputs.get(len(stream.blocks)))
        if variants is not None:
            task = bar.add_task("Fisher pass: head's widths")
            for m, t in taps.items():
                hessian = (head_moments or {}).get(m)
                if hessian is None:
                    hessian = _head_moments(stream, t.linear, finals, ids)
                _add_variants(stream, acc, m, variants, hessian, lambda: bar.advance(task))
            bar.finish(task)
        vocab = stream.source.config.vocab_size
        width = max(1, HEAD_LOGITS // vocab)  # positions at once: logits stay a few MiB
        chunks = sum(-(-row.shape[1] // width) for row in ids)
        chunks += sum(len(t.row_chunks(acc.errors[m])) for m, t in terms.items())
        keys = {m: [m, *_variant_keys(acc, m)] for m in taps}
        task = bar.add_task("Fisher pass: head", total=chunks)
        for s, (final, row) in enumerate(zip(finals, ids, strict=True)):
            per_draw: list[list[torch.Tensor]] = [[] for _ in range(draws)]
            for start in range(0, row.shape[1], width):
                h = final[:, start : start + width].clone().requires_grad_(True)
                logits = stream.head_logits(h, row[:, start : start + width])
                logp = torch.log_softmax(logits.float()[0], -1)
                sampled = logp.detach()
                for m, t in list(terms.items()):
                    if not t.add_positions(taps[m].x.float(), logits.detach().float()[0]):
                        del terms[m]  # logits not the Linear's own: the taps measure it
                        for key in keys[m][1:]:  # and no variants
                            del acc.errors[key]
                        keys[m] = [m]
                    else:
                        sampled = t.log_probs  # labels drawn from what the terms price
                moved = {m: t.times_error(acc.errors[m]) for m, t in taps.items()
                         if m not in terms}
                for d in range(draws):
                    acc.at = (s, d)
                    labels = _sample(sampled, gen)
                    logp.gather(1, labels).sum().backward(retain_graph=d < draws - 1)
                    per_draw[d].append(h.grad)
                    h.grad = None
                    for m, t in taps.items():
                        if m not in terms:
                            acc.add(m, (t.grad * moved[m]).sum())
                        for key in keys[m] if m in terms else ():
                            acc.add(key, terms[m].label_term(acc.errors[key], labels))
                bar.advance(task)
            for t in terms.values():
                t.end_sequence()
            grads.append([torch.cat(parts, dim=1) for parts in per_draw])
        for m, t in terms.items():
            errors = [acc.errors[key] for key in keys[m]]
            for key, expected in zip(keys[m], t.expected_terms(errors, lambda: bar.advance(
                    task)), strict=True):
                for s, term in enumerate(expected):
                    for d in range(draws):
                        acc.at = (s, d)
                        acc.add(key, -term)
    finally:
        for t in taps.values():
            t.hook.remove()
        for _, module in heads:
            stream.release(module)
        stored: dict[int, torch.Tensor] = {}
        for error in acc.errors.values():
            error.keep_as_stored(stored)
    return grads


def head_input_moments(cal: CalibrationPass, modules: set[str]) -> dict[str, torch.Tensor]:
    """X^T X / n of the inputs of the output head(s) among ``modules`` (by the module they
    quantize: a tied embedding's name) over a calibration pass's positions: what a head's
    compensated codes are fitted to (the more windows, the less they fit the sample)."""
    stream = cal.stream
    ids = _sequences(list(stream.chunks()))
    finals = _sequences(cal.inputs.get(len(stream.blocks)))
    out = {}
    with stream.heads_held() as parts:
        for name, module in parts:
            key = _module_of(stream, f"{name}.weight")
            if key in modules and isinstance(module, nn.Linear):
                out[key] = _head_moments(stream, module, finals, ids)
    return out


def _head_moments(stream: BlockStream, linear: nn.Module, finals: list[torch.Tensor],
                  ids: list[torch.Tensor]) -> torch.Tensor:
    """X^T X / n of the head Linear's inputs over the calibration positions (the final norm
    runs, the vocabulary-wide product does not)."""
    moments = GramAccumulator(linear.in_features)
    stream.head_inputs(linear, finals, ids, moments.add)
    return moments.mean()


def _spec_of(stream: BlockStream, module: str) -> TensorSpec:
    return next(s for s in stream.specs.values() if s.module == module)


def _add_variants(stream: BlockStream, acc: _Accumulator, module: str, variants: Variants,
                  hessian: torch.Tensor | None, done: Callable[[], None] = lambda: None
                  ) -> None:
    """The module's variants' errors, beside its probe's (keyed ``MODULE|NAME``; ``done``
    after each)."""
    error = acc.errors[module]
    spec = _spec_of(stream, module)
    for name, qt in variants(spec, error.weight.float(), hessian):
        if qt is not None:
            acc.errors[f"{module}|{name}"] = ModuleError(qt, error.weight, spec.dtype)
        done()


def _variant_keys(acc: _Accumulator, module: str) -> list[str]:
    return sorted(k for k in acc.errors if k.startswith(f"{module}|"))


def _softcap(config) -> float | None:
    """The model's final logit soft-capping (Gemma 2), if any."""
    for cfg in (config, getattr(config, "text_config", None)):
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            return float(cap)
    return None


class _HeadTerms:
    """The head's G . dW for logits l = T(z), z = x W^T + b (T: identity or soft-capping),
    without a vocabulary-wide product per chunk of positions. The sampled log-likelihood's
    gradient at z is T'(z) (onehot(y) - softmax(l)), so with dz = x dW^T

        G . dW = sum_p T'(z_py) x_p . dW_y  -  sum_(p,v) T'(z_pv) softmax(l_p)_v x_p . dW_v:

    the first term reads the drawn labels' rows of the error (``label_term``, per draw); the
    second is the same for every draw of a sequence (``expected_terms``): once at the end, a
    chunk of rows at a time over every position, so the error is dequantized once per pass,
    not once per chunk of positions. The logits are recomputed here in float32 and the labels
    drawn from them, so that both terms price the same distribution."""

    def __init__(self, linear: nn.Module, cap: float | None) -> None:
        self.linear, self.cap = linear, cap
        self.x: list[torch.Tensor] = []  # per position chunk of the running sequence
        self.lse: list[torch.Tensor] = []
        self.sequences: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, logsumexp)
        self.log_probs = torch.empty(0)
        self._tprime = torch.empty(0)
        self._chunk = torch.empty(0)

    def _logits(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """T(z) and T'(z)."""
        if self.cap is None:
            return z, torch.ones(())
        t = torch.tanh(z / self.cap)
        return t * self.cap, 1 - t * t

    def _z(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """x W^T + b in float32, multiplied in the weight's dtype (the model's own product)."""
        w, b = self.linear.weight, self.linear.bias
        rows = rows or slice(None)
        return F.linear(x.to(w.dtype), w[rows], None if b is None else b[rows]).float()

    def add_positions(self, x: torch.Tensor, logits: torch.Tensor) -> bool:
        """Take a chunk's head inputs; False if the model's logits are not T(x W^T + b) (checked
        on the first chunk, before any term is added)."""
        logit, tprime = self._logits(self._z(x))
        first = not (self.x or self.sequences)
        scale = 1.0 + float(logits.abs().max())
        if first and float((logit - logits).abs().max()) > HEAD_MATCH * scale:
            return False
        lse = torch.logsumexp(logit, -1)
        self.log_probs = logit - lse[:, None]
        self._tprime, self._chunk = tprime, x
        self.x.append(x)
        self.lse.append(lse)
        return True

    def label_term(self, error: ModuleError, labels: torch.Tensor) -> torch.Tensor:
        """sum_p T'(z_py) x_p . dW_y for this chunk's drawn labels [positions, 1]."""
        moved = (self._chunk * error.rows(labels[:, 0])).sum(-1)
        tprime = (self._tprime if self._tprime.ndim == 0
                  else self._tprime.gather(1, labels)[:, 0])
        return (tprime * moved).sum()

    def end_sequence(self) -> None:
        self.sequences.append((torch.cat(self.x), torch.cat(self.lse)))
        self.x, self.lse = [], []

    def row_chunks(self, error: ModuleError) -> range:
        rows = error.weight.shape[0]
        return range(0, rows, max(1, ROWS_CHUNK // error.weight.shape[1]))

    def expected_terms(self, errors: list[ModuleError], done: Callable[[], None]
                       ) -> list[list[float]]:
        """Per error, per sequence: sum_(p,v) T'(z_pv) softmax_pv x_p . dW_v = <dW, A_s> with
        A_s = sum_p (T' softmax)_p^T x_p, formed once per chunk of rows and sequence for every
        error (each error then costs its dequantization and a dot product, not a
        vocabulary-wide matrix product); ``done`` after each chunk of rows."""
        x = torch.cat([xs for xs, _ in self.sequences])
        lse = torch.cat([ls for _, ls in self.sequences])
        bounds = [0]
        for xs, _ in self.sequences:
            bounds.append(bounds[-1] + len(xs))
        chunks = self.row_chunks(errors[0])
        totals = [[0.0] * len(self.sequences) for _ in errors]
        for r in chunks:
            chunk = slice(r, min(r + chunks.step, chunks.stop))
            logit, tprime = self._logits(self._z(x, chunk))
            weight = torch.exp(logit - lse[:, None]).mul_(tprime)
            moved = [error.rows(chunk).reshape(-1) for error in errors]
            for s, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                expected = (weight[lo:hi].T @ x[lo:hi]).reshape(-1)  # [rows * in]
                for total, dw in zip(totals, moved, strict=True):
                    total[s] += float(torch.dot(expected, dw))
            done()
        return totals


def _module_of(stream: BlockStream, param: str) -> str | None:
    spec = stream.specs.get(stream.tied.get(param, param))
    return None if spec is None else spec.module


@dataclass
class FisherShard:
    """One job of a block's backward: a shard of the block's input (its chunks with their
    recorded arguments) and each of its sequences' gradients at the block's output (one per
    draw)."""

    shard: BlockShard
    grads: list[list[torch.Tensor]]


@dataclass
class BlockProbes:
    """What a block's jobs share: where the weights are, and the probe-width codes of the
    block's measured modules (module -> codes)."""

    work: BlockWork
    probes: dict[str, QuantizedTensor]


def fisher_block_job(job: FisherShard, block: BlockProbes
                     ) -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """The shard's G . dW per module ([its sequences, draws]) and its sequences' gradients at
    the block's input."""
    use_threads(block.work.threads)
    stream = shard_stream(block.work)
    acc = _Accumulator(len(job.grads), len(job.grads[0]))
    below = _block_backward(stream, job.shard.block, job.shard.hidden, list(job.grads),
                            set(block.work.modules), lambda spec, _w: block.probes[spec.module],
                            acc, job.shard.recorded)
    return acc.products, below


def _block_probes(stream: BlockStream, index: int, modules: set[str],
                  probe_weight: ProbeWeight) -> dict[str, QuantizedTensor]:
    """The probe-width codes of block ``index``'s measured modules, from its weights as the
    backward materializes them (the codes every shard's errors are made of)."""
    prefix = stream.block_prefix(index)
    probes = {}
    with block_as_driven(stream, index, {}) as block:
        for name, owner, leaf in parameter_slots(block):
            spec = stream.specs.get(stream.tied.get(f"{prefix}.{name}", f"{prefix}.{name}"))
            if spec is not None and spec.module in modules and spec.module not in probes:
                probes[spec.module] = probe_weight(spec, owner._parameters[leaf].detach())
    return probes


def _shards(stream: BlockStream, index: int, inputs: list[torch.Tensor],
            grads: list[list[torch.Tensor]], sequences: int) -> list[FisherShard]:
    """Block ``index``'s jobs, in order: the calibration pass's shards of about ``sequences``
    sequences each, with their sequences' gradients."""
    jobs, first = [], 0
    for shard in shards_of(stream, index, inputs, sequences=sequences):
        count = sum(c.shape[0] for c in shard.hidden)
        jobs.append(FisherShard(shard, grads[first : first + count]))
        first += count
    return jobs


def _block_backward(stream: BlockStream, index: int, inputs: list[torch.Tensor],
                    grads: list[list[torch.Tensor]], modules: set[str],
                    probe_weight: ProbeWeight, acc: _Accumulator,
                    recorded: list[tuple] | None = None) -> list[list[torch.Tensor]]:
    """Per sequence of ``inputs`` (its chunks; ``recorded``: their arguments when not the
    stream's own) and draw: the products of the block's modules into ``acc``, and the
    gradient at the block's input."""
    block, prefix = stream.blocks[index], stream.block_prefix(index)
    # Linears are measured by taps (no weight gradients); expert banks by gradient hooks
    linears = {f"{prefix}.{n}.weight": m for n, m in block.named_modules()
               if isinstance(m, nn.Linear)}
    linears = {p: m for p, m in linears.items() if _module_of(stream, p) in modules}
    watched = set(_watch(stream, block, prefix, modules, probe_weight, acc,
                         tapped=frozenset(linears)))
    taps = {_module_of(stream, p): _LinearTaps(m) for p, m in linears.items()}
    args = [a for a, chunk in zip(recorded or stream.calls[index], inputs, strict=True)
            for _ in range(chunk.shape[0])]
    out = []
    try:
        for s, (x, (a, kw)) in enumerate(zip(_sequences(inputs), args, strict=True)):
            x = x.to(stream.dtype, copy=True).requires_grad_(True)
            y = first_output(block(x, *a, **kw))
            moved = {m: t.times_error(acc.errors[m]) for m, t in taps.items()}
            per_draw, grads[s] = grads[s], []  # dropped as used: one level of them alive
            below = []
            for d, g in enumerate(per_draw):
                acc.at = (s, d)
                y.backward(g.to(y.dtype), retain_graph=d < len(per_draw) - 1)
                for m, t in taps.items():
                    acc.add(m, (t.grad * moved[m]).sum())
                below.append(x.grad)
                x.grad = None
            out.append(below)
    finally:
        for t in taps.values():
            t.hook.remove()
        acc.unwatch()
        stream.release(block)
        for m in watched:
            acc.errors.pop(m, None)
    return out


def _embedding_backward(stream: BlockStream, grads: list[list[torch.Tensor]],
                        modules: set[str], probe_weight: ProbeWeight, acc: _Accumulator,
                        variants: Variants | None = None) -> None:
    """The input embedding's share: a token reads one row, so a sequence's gradient is its
    hidden-state gradients summed into the rows of its tokens (times the factor a scaled
    embedding multiplies its rows by)."""
    embed = stream.model.get_input_embeddings()
    prefix = stream.module_name(embed)
    spec = stream.specs.get(f"{prefix}.weight")
    if spec is None or spec.module not in modules:
        return
    scale = embedding_scale(embed)
    factor = 1.0 if scale is None else float(
        torch.tensor(scale.value).to(stream.dtype if scale.in_row_dtype else torch.float32))
    sequences = _sequences(list(stream.chunks()))
    error = acc.errors.get(spec.module)  # the whole table's, when tied to the lm_head
    read = torch.arange(spec.shape[0])
    if error is None:  # only the rows the calibration tokens read matter: quantize just those
        read = torch.cat([row[0] for row in sequences]).unique()
        w = stream.weights.get(spec)[read]
        error = ModuleError(probe_weight(spec, w.float()), w, spec.dtype)
        acc.errors[spec.module] = error
        if variants is not None:
            _add_variants(stream, acc, spec.module, variants, None)
    keys = [spec.module, *_variant_keys(acc, spec.module)]
    for s, (row, per_draw) in enumerate(zip(sequences, grads, strict=True)):
        rows, inverse = row[0].unique(return_inverse=True)
        at = torch.searchsorted(read, rows)
        for d, g in enumerate(per_draw):
            acc.at = (s, d)
            summed = torch.zeros(len(rows), g.shape[-1]).index_add_(0, inverse, g[0].float())
            for key in keys:
                acc.add(key + LOOKUP_USE, factor * (summed * acc.errors[key].rows(at)).sum())
