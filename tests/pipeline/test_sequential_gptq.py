"""Sequential GPTQ: block by block over the quantized model's own activations, groups
of Linears in forward order, every width better than round-to-nearest on a trained model,
byte-identical reruns and resumes, one-line errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.calibrate.text import calibration_ids, default_calibration
from dynquant.pipeline.codes import sequential_gptq as seq
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.execute.executor import LocalExecutor
from shipped_models import LLAMA_REF, checkpoint_bytes
from worker_executor import AsAWorker

ROOT = Path(__file__).parents[2]


def _calibration(model_dir: Path, seqs: int = 8, length: int = 128) -> SequentialCalibration:
    tok = load_tokenizer(model_dir)
    return SequentialCalibration(calibration_ids(tok, [str(default_calibration())], seqs,
                                                 length))


def _uniform(source, bits: int) -> dict[str, int]:
    return {s.module: bits for s in source.tensor_specs() if s.quantizable}


def _block_groups(model_dir: Path, b: int) -> tuple[list[list[str]], dict]:
    from dynquant.pipeline.calibrate.block_stream import BlockStream
    from dynquant.pipeline.calibrate.weights import weight_source

    source = resolve_model(str(model_dir))
    weights = weight_source(source, False)
    stream = BlockStream(source, weights, _calibration(model_dir, 1).ids, chunk=1)
    hidden = stream.record()
    prefix = stream.block_prefix(b) + "."
    stream.materialize(stream.blocks[b], prefix[:-1])
    mine = [s for s in source.tensor_specs() if s.quantizable and s.name.startswith(prefix)]
    targets = seq._targets(stream.blocks[b], prefix, mine)
    groups = seq._groups(stream, b, hidden[0], targets)
    weights.close()
    return [[m.removeprefix(prefix) for m in g] for g in groups], targets


def test_groups_follow_the_forward_and_shared_inputs():
    groups, _ = _block_groups(LLAMA_REF, 0)
    assert groups == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                      ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    # the hybrid model's attention block: its expert banks are found by their products, used
    # as x @ W[e] (stored [E, in, out]), after the shared expert as the forward runs them
    groups, targets = _block_groups(ROOT / "models" / "hybrid-ref", 1)
    assert groups == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                      ["self_attn.o_proj"], ["moe.sw1", "moe.sw3"], ["moe.sw2"],
                      ["moe.w1", "moe.w3"], ["moe.w2"]], groups
    assert targets["model.layers.1.moe.w1"].rows and targets["model.layers.1.moe.w2"].rows


def test_sequential_gptq_beats_round_to_nearest_at_every_width(tmp_path):
    """On the trained reference model, uniform widths, KL on held-out text: every width."""
    from dynquant.pipeline.report.frontier import evaluate_checkpoints

    source = resolve_model(str(LLAMA_REF))
    cal = _calibration(LLAMA_REF)
    names = []
    for bits in (2, 3, 4, 8):
        for kind, chooser in (("rtn", CodeChooser()),
                              ("gptq", CodeChooser("gptq", sequential=cal))):
            quantize_model(source, _uniform(source, bits), tmp_path / f"{kind}{bits}",
                           progress=False, chooser=chooser)
            names.append(f"{kind}{bits}")
    res = evaluate_checkpoints(LLAMA_REF, tmp_path, names, ROOT / "data" / "heldout.txt", 256,
                               1024, "float32")
    for bits in (2, 3, 4, 8):
        ratio = res[f"gptq{bits}"].kl_mean / res[f"rtn{bits}"].kl_mean
        assert ratio < 0.7, (bits, ratio)  # measured 0.38-0.49 (1,024 calibration tokens)


@pytest.mark.parametrize("float_targets", [0.0, 1.0])
def test_reruns_and_resumes_are_byte_identical(tmp_path, monkeypatch, float_targets):
    """GPTQ's own codes, and GPTAQ's (``float_targets``: a resumed pass runs the float model
    again for the float inputs of the blocks it has left)."""
    source = resolve_model(str(LLAMA_REF))
    widths = {**_uniform(source, 3), "model.layers.1.mlp.down_proj": 4}
    cal = replace(_calibration(LLAMA_REF, 2, 64), float_targets=float_targets)
    for run in ("a", "b"):
        quantize_model(source, widths, tmp_path / run, progress=False,
                       chooser=CodeChooser("gptq", sequential=cal))
    assert checkpoint_bytes(tmp_path / "a") == checkpoint_bytes(tmp_path / "b")

    calls = {"n": 0}
    real = seq.gptq_quantize

    def dies_on_the_ninth(*args, **kwargs):  # block 1's k_proj: a crash mid-group
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(seq, "gptq_quantize", dies_on_the_ninth)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(source, widths, tmp_path / "c", progress=False,
                       chooser=CodeChooser("gptq", sequential=cal))
    assert not (tmp_path / "c" / "dynquant.json").exists()
    monkeypatch.setattr(seq, "gptq_quantize", real)
    calls["n"] = 0
    computed = []
    monkeypatch.setattr(seq, "gptq_quantize", lambda *a, **k: computed.append(1) or real(*a, **k))
    quantize_model(source, widths, tmp_path / "c", progress=False,
                   chooser=CodeChooser("gptq", sequential=cal))
    assert len(computed) == 28 + 1 - 8  # the finished modules came from the store (+1: head)
    assert checkpoint_bytes(tmp_path / "c") == checkpoint_bytes(tmp_path / "a")


def test_window_shards_run_by_a_worker_give_the_driver_s_bytes(tmp_path):
    """12 windows: two shards (8 + 4) per group's moments, folded in order, and a window a job
    for each block's outputs; run as a worker runs them (weights from the files, earlier groups' codes sent
    with the job), the checkpoint is the one-process checkpoint, byte for byte; in a bfloat16
    pass too (the workers' blocks bf16 as the driver's), whose codes are its own."""
    source = resolve_model(str(LLAMA_REF))
    widths = {**_uniform(source, 3), "model.layers.1.mlp.down_proj": 4}
    written = {}
    for dtype in ("float32", "bfloat16"):
        chooser = CodeChooser("gptq", sequential=replace(_calibration(LLAMA_REF, 12, 32),
                                                         dtype=dtype))
        for run, executor in (("here", LocalExecutor()), ("worker", AsAWorker())):
            quantize_model(source, widths, tmp_path / dtype / run, progress=False,
                           chooser=chooser, executor=executor)
            written[dtype, run] = checkpoint_bytes(tmp_path / dtype / run)
        assert written[dtype, "here"] == written[dtype, "worker"]
    assert written["float32", "here"] != written["bfloat16", "here"]


def test_gptq_needs_text_it_can_find(tmp_path, capsys):
    from dynquant.cli import main
    from model_zoo import save_tiny_model, save_tiny_tokenizer

    src = save_tiny_model("llama", tmp_path / "src")  # weights, no tokenizer yet
    widths = tmp_path / "w.json"
    widths.write_text(json.dumps(_uniform(resolve_model(str(src)), 4)))
    own = tmp_path / "own.txt"
    own.write_text("a text of my own, " * 200)
    runs = [(src, ["--widths", str(widths)], "needs model weights and a tokenizer"),
            ("tiny", ["--random-init", "--uniform", "4"], "needs model weights and a tokenizer"),
            (src, ["--widths", f"{tmp_path / 'maps.json'}:4.5"], "give that text again")]
    for model, extra, message in runs:
        if extra[0] == "--widths" and "maps" in extra[1]:
            save_tiny_tokenizer(src)
            assert main(["measure", str(src), "-o", str(tmp_path / "maps.json"), "--calib",
                         str(own), "--calib-seqs", "2", "--calib-len", "32"]) == 0
        capsys.readouterr()
        assert main(["quantize", str(model), "-o", str(tmp_path / "x"), *extra, "--quantizer",
                     "gptq", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x").exists()


def test_transformers_expert_banks_are_compensated_per_expert(tmp_path):
    """Banks stored [E, out, in] and used as F.linear(x, W[e]) (transformers' experts
    modules): found by their products, each expert compensated on its routed tokens."""
    from dynquant.format.validate import validate_checkpoint
    from model_zoo import save_tiny_model, save_tiny_tokenizer

    src = save_tiny_model("qwen3_moe", tmp_path / "src")
    save_tiny_tokenizer(src)
    groups, targets = _block_groups(src, 0)
    flat = [m for g in groups for m in g]
    assert flat.index("mlp.experts.gate_up_proj") < flat.index("mlp.experts.down_proj")
    bank = targets["model.layers.0.mlp.experts.gate_up_proj"]
    assert bank.bank and not bank.rows
    source = resolve_model(str(src))
    cal = _calibration(src, 4, 64)
    for kind, chooser in (("rtn", CodeChooser()), ("gptq", CodeChooser("gptq", sequential=cal))):
        quantize_model(source, _uniform(source, 3), tmp_path / kind, progress=False,
                       chooser=chooser)
        assert validate_checkpoint(str(tmp_path / kind)) == []
    from safetensors.torch import load_file

    rtn, gptq = (load_file(tmp_path / k / "model.safetensors") for k in ("rtn", "gptq"))
    name = "model.layers.0.mlp.experts.down_proj.qweight"
    assert rtn[name].shape == gptq[name].shape and not rtn[name].equal(gptq[name])
