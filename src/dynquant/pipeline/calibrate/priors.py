"""The data-free sensitivity: what a module's relative weight error costs, without any text.

A module's relative error r = ||dW||^2 / ||W||^2 becomes (for inputs without strong structure) a
relative error of about r in what it writes, so the cost of r depends on where the module
writes, not on its size or weight norm (a proxy such as usage x ||W||^2 makes large-norm modules
expensive and puts e.g. a layer-0 v_proj with small weights at 2 bits on a real model). The
priors below are relative costs per unit of relative error by role and depth, read off the
calibrated (Fisher) sensitivities of three models: the two reference models (dense Llama, hybrid
conv/attention MoE) and SmolLM2-135M (30 blocks). On each, the calibrated sensitivity per unit
of relative error clusters by role within a factor of about 3, with these regularities:

- the tied embedding (which is also the output head) costs ~100x a block module: its error is
  in every logit directly;
- the value path costs more than the rest of attention (a value error passes linearly to the
  output, once per query head sharing it), queries and keys least (softmax damps them);
- MLP outputs (down projections) a little more than MLP inputs;
- block 0 costs ~3x (every later block reads its output), the last block's MLP ~2x (its
  output is the head's input).

With these (and the quantizer's column statistics from random tokens, ``measure/run.py``), the
data-free checkpoints' measured KL is close to the calibrated ones' at equal bytes on all three
models (BENCHMARKS.md "Calibrated vs data-free defaults").
"""

from __future__ import annotations

import re

from dynquant.format.planner import TensorSpec

HEAD = 100.0  # output head, and a tied embedding (which is the head too)
UNTIED_EMBEDDING = 3.0  # an error in every token's input: like a block-0 branch
ROLE = {
    "v_proj": 2.0, "q_proj": 0.3, "k_proj": 0.3, "o_proj": 0.5,
    "in_proj": 2.0, "out_proj": 1.0,  # short convolutions: a value-like path in, output out
    "gate_proj": 1.0, "up_proj": 1.0, "gate_up_proj": 1.0, "w1": 1.0, "w3": 1.0,
    "sw1": 1.0, "sw3": 1.0,
    "down_proj": 1.5, "w2": 1.5, "sw2": 1.5,
}
MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj", "w1", "w2", "w3", "sw1", "sw2", "sw3")
FIRST_BLOCK = 3.0
LAST_BLOCK_MLP = 2.0
_BLOCK = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def block_index(module: str) -> int | None:
    found = _BLOCK.search(module)
    return int(found.group(1)) if found else None


def data_free_sensitivity(spec: TensorSpec, blocks: int, tied: bool) -> float:
    """The relative cost of one unit of relative error in ``spec`` (a model of ``blocks``
    blocks; ``tied``: the input embedding is also the output head)."""
    leaf = spec.module.rsplit(".", 1)[-1]
    if leaf == "lm_head" or (leaf in ("embed_tokens", "wte", "word_embeddings") and tied):
        return HEAD
    if leaf in ("embed_tokens", "wte", "word_embeddings"):
        return UNTIED_EMBEDDING
    prior = ROLE.get(leaf, 1.0)
    block = block_index(spec.module)
    if block == 0:
        prior *= FIRST_BLOCK
    elif block is not None and block == blocks - 1 and leaf in MLP:
        prior *= LAST_BLOCK_MLP
    return prior
