"""The Ray executor on a local Ray cluster (one worker CPU): the same bytes as a local run, results in
order with bounded in-flight tasks, a killed worker survived, workers' typed errors kept."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray executor needs ray (pip install "
                          "'dynquant[ray]'; make test installs it)")

from killed_run import killed_quantize, quantize_argv  # noqa: E402

from dynquant.cli import main  # noqa: E402
from dynquant.pipeline.execute.ray_executor import RayExecutor  # noqa: E402
from model_zoo import TOKENIZER_TEXT, save_tiny_model, save_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance with one worker CPU for the module's tests, up."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers lack tests/
    executor = RayExecutor(workers=1)
    assert list(executor.map(_shifted, range(2), 0)) == [0, 1]
    yield executor
    executor.close()


def _shifted(job: int, shift: int) -> int:
    time.sleep(0.01 * (job % 3))  # later jobs often finish first
    return job + shift


def _digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its path there -> SHA-256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _quantize(model: Path, out: Path, *extra: str) -> None:
    assert main(["quantize", str(model), "-o", str(out), "--quiet", *extra]) == 0


def test_results_come_back_in_order_with_bounded_tasks_in_flight(cluster):
    bounded = RayExecutor(max_in_flight=3)
    assert list(bounded.map(_shifted, range(25), 100)) == list(range(100, 125))
    assert bounded.peak_in_flight == 3  # never more submitted and not yet collected
    assert cluster.slots(1) == 1  # one worker CPU
    submitted = [cluster.submit(_shifted, job, 1) for job in range(3)]  # all started at once
    assert [s.result() for s in submitted] == [1, 2, 3] and all(s.done() for s in submitted)
    by_bytes = RayExecutor(max_in_flight_bytes=10)  # results of 4 bytes: 2 fit, a third not
    assert list(by_bytes.map(_shifted, range(9), 1, nbytes=lambda _job: 4)) == list(range(1, 10))
    assert by_bytes.peak_in_flight == 2


@pytest.mark.parametrize(("family", "mode"), [
    ("qwen3_moe", ()), ("dynquant_hybrid", ("--tune-rounding", "0", "--e2e-steps", "0")),
    ("qwen3_moe", ("--tune-on", "float", "--e2e-steps", "0")),
    ("dynquant_hybrid", ("--chain-blocks", "2", "--e2e-steps", "0"))])
def test_ray_run_is_byte_identical_to_a_local_run(cluster, tmp_path, family, mode):
    """measure (calibration shards and candidates on the workers) -> allocate -> quantize (the
    gptq pass's windows in two shards, 8 + 4, each group's X^T X and each block's outputs, each
    matrix's compensation and the other tensors on the workers; each block's scales then tuned
    on the driver with the codes' rounding, from the residuals the compensation jobs send back
    (the default codes), expert banks included; with ``--tune-rounding 0`` the scales alone
    (no residuals asked for); with ``--tune-on float``
    each block's tuning a job on a worker beside the pass; with ``--chain-blocks 2`` each
    chain of two blocks a job, their GPTQ codes and tuning): the same files, byte for byte; the
    moments folded from the shards are the local run's bits, or the codes would differ. The
    end-to-end scales run on the driver from the codes: the default's run has them, the others
    (which differ before them) leave them out.
    (The data-free path: test_a_killed_worker_is_survived.)"""
    model = save_tiny_model(family, tmp_path / "src")
    save_tiny_tokenizer(model, vocab_size=512 if family == "dynquant_hybrid" else 384)
    (tmp_path / "calib.txt").write_text(TOKENIZER_TEXT * 3)
    extra = ["--budget", "5.0", "--calib", str(tmp_path / "calib.txt"), "--calib-seqs", "2",
             "--calib-len", "32", "--gptq-seqs", "12", "--tune-steps", "20", *mode]
    _quantize(model, tmp_path / "local", *extra)
    _quantize(model, tmp_path / "ray", *extra, "--ray")
    assert _digest(tmp_path / "local") == _digest(tmp_path / "ray")
    doc = json.loads((tmp_path / "ray" / "dynquant.json").read_text())
    assert doc["provenance"]["allocator"] == "sensitivity"


def _kill_first_task(prefixes: tuple[str, ...], stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the first Ray worker seen running one of the tasks (process title ray::NAME)."""
    while not stop.is_set() and not killed:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
            if title.startswith(prefixes):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return


def test_the_instance_it_starts_keeps_idle_workers(cluster):
    """The Ray instance the executor starts keeps a worker idle for IDLE_WORKER_SECONDS, not
    Ray's 1 s: a block's jobs come in bursts with the driver's factor between them, and with
    the default Ray retired warm workers and started new ones, each paying its imports (a
    SmolLM2 calibrated quantize 2.5x slower: BENCHMARKS.md "Past one machine")."""
    from dynquant.pipeline.execute.ray_executor import IDLE_WORKER_SECONDS

    config = ray._private.worker._global_node._ray_params._system_config
    assert config["idle_worker_killing_time_threshold_ms"] == IDLE_WORKER_SECONDS * 1000
    assert IDLE_WORKER_SECONDS >= 60


def test_a_killed_worker_is_survived(cluster, tmp_path):
    """A worker killed in the middle of a task: Ray runs the task again, the checkpoint is the
    local run's, byte for byte (a data-free measure and quantize, every module's candidates and
    codes on the workers). The embedding's tasks take long enough to be caught."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    _quantize(tmp_path / "src", tmp_path / "local", "--uniform", "3")
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_first_task, args=(
        ("ray::block_shard_job", "ray::candidates_job", "ray::quantize_job"), stop, killed))
    watcher.start()
    try:
        _quantize(tmp_path / "src", tmp_path / "ray", "--uniform", "3", "--ray")
    finally:
        stop.set()
        watcher.join()
    assert killed, "no worker was caught running a task"
    assert _digest(tmp_path / "local") == _digest(tmp_path / "ray")


def test_a_workers_error_is_one_typed_line(cluster, tmp_path, capsys):
    """A tensor missing from the model's files, found by the worker reading it: the CLI prints
    the worker's own error (file and module named) in one line and exits 2."""
    from safetensors.torch import load_file, save_file

    model = save_tiny_model("llama", tmp_path / "src")
    _quantize(model, tmp_path / "whole", "--uniform", "4")
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["quantize", str(model), "-o", str(tmp_path / "q"), "--quiet", "--widths",
                 str(tmp_path / "whole" / "dynquant.json"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "model.layers.1.mlp.down_proj.weight" in err and "missing" in err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("pricing", ["gptq", "rtn"])
def test_calibrated_measure_in_shards_is_byte_identical(cluster, tmp_path, pricing):
    """The calibration passes in shards of 8 sequences (10 for the statistics, 20 for X^T X:
    2 and 3 shards per block, run on the workers), candidates priced with compensated codes
    (matrix products: the workers take on the driver's thread count), or (the default) rounded
    to nearest with each Linear's gptq ratios taken on the workers as the pass sums X^T X:
    the same maps, statistics and second moments on Ray as here."""
    model = save_tiny_model("qwen3_moe", tmp_path / "src")
    save_tiny_tokenizer(model)
    (tmp_path / "calib.txt").write_text(TOKENIZER_TEXT * 12)
    args = ["--calib", str(tmp_path / "calib.txt"), "--calib-seqs", "10", "--calib-len", "32",
            "--moment-seqs", "20", "--quantizer", pricing, "--no-forecast-check", "--quiet"]
    assert main(["measure", str(model), "-o", str(tmp_path / "a" / "maps.json"), *args]) == 0
    assert main(["measure", str(model), "-o", str(tmp_path / "b" / "maps.json"), *args,
                 "--ray"]) == 0
    files = _digest(tmp_path / "a")
    assert "maps.stats.safetensors" in files
    assert ("maps.moments/block_001.safetensors" in files) == (pricing == "gptq")
    if pricing == "rtn":
        doc = json.loads((tmp_path / "a" / "maps.json").read_text())
        assert all("gptq_width_ratios" in m for n, m in doc["modules"].items()
                   if ".layers." in n and len(m["logical_shape"]) == 2)
    assert files == _digest(tmp_path / "b")


def test_a_killed_driver_resumes_to_identical_bytes(cluster, tmp_path):
    """The driver killed (SIGKILL) after 20 tensors of a run on the cluster at an address: the
    cluster lives on, the rerun resumes from the resume store and writes the local run's
    bytes."""
    address = ray.get_runtime_context().gcs_address
    assert killed_quantize(tmp_path / "a", 20, "--ray", address) == -signal.SIGKILL
    assert len(list((tmp_path / ".a.partial").glob("*.safetensors"))) == 20
    assert main(quantize_argv(tmp_path / "a", "--ray", address)) == 0  # resumed on the cluster
    assert main(quantize_argv(tmp_path / "b")) == 0
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
