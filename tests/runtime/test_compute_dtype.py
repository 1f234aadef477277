"""The compute dtype follows the CPU: bfloat16 only where bf16 dot products are native."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dynquant.cli import build_parser
from dynquant.numerics import compute_dtype as cd

# Flag sets as /proc/cpuinfo prints them (abridged), one per CPU class.
SAPPHIRE_RAPIDS = "fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN4 = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vbmi avx512_bf16 avx512_vnni"
SKYLAKE_X = "fpu sse2 avx avx2 fma avx512f avx512bw avx512cd avx512dq avx512vl"
ZEN3 = "fpu sse2 avx avx2 fma f16c bmi2"
OLD_X86 = "fpu sse sse2 ssse3 sse4_1 sse4_2"
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm sve"
GRAVITON2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp"


@pytest.mark.parametrize(("flags", "dtype", "cls"), [
    (SAPPHIRE_RAPIDS, torch.bfloat16, "avx512-bf16"),
    (ZEN4, torch.bfloat16, "avx512-bf16"),
    (SKYLAKE_X, torch.float32, "avx512"),  # AVX-512 without bf16: emulated, float32
    (ZEN3, torch.float32, "avx2"),
    (OLD_X86, torch.float32, "portable"),
    (GRAVITON3, torch.bfloat16, "arm-bf16"),
    (GRAVITON2, torch.float32, "arm"),
    ("", torch.float32, "portable"),  # flags that cannot be read: the safe choice
])
def test_the_dtype_decision_from_flag_sets(flags, dtype, cls, monkeypatch):
    monkeypatch.delenv("DYNQUANT_DTYPE", raising=False)  # the override has its own test
    flags = flags.split()
    assert cd.auto_dtype(flags) == dtype
    assert cd.cpu_class(flags) == cls
    assert cd.resolve_dtype(None, flags) == dtype
    assert cd.resolve_dtype("auto", flags) == dtype


def test_explicit_requests_and_the_environment_override_auto(monkeypatch):
    monkeypatch.delenv("DYNQUANT_DTYPE", raising=False)
    assert cd.resolve_dtype("float32", ZEN4.split()) == torch.float32
    assert cd.resolve_dtype("bfloat16", ZEN3.split()) == torch.bfloat16
    assert cd.resolve_dtype(torch.float32) == torch.float32
    monkeypatch.setenv("DYNQUANT_DTYPE", "float32")
    assert cd.resolve_dtype(None, ZEN4.split()) == torch.float32
    assert cd.resolve_dtype("bfloat16", ZEN3.split()) == torch.bfloat16  # explicit beats env
    monkeypatch.setenv("DYNQUANT_DTYPE", "half")
    with pytest.raises(ValueError, match="DYNQUANT_DTYPE must be one of auto, bfloat16"):
        cd.resolve_dtype(None)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        cd.resolve_dtype(torch.float16)


def _cpuinfo_flags() -> set[str]:
    """/proc/cpuinfo's feature line, read here without dynquant's reader."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads /proc/cpuinfo")
def test_this_machine_reads_its_own_flags(monkeypatch):
    monkeypatch.delenv("DYNQUANT_DTYPE", raising=False)
    flags = _cpuinfo_flags()
    assert cd.cpu_flags() == frozenset(flags)
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags) or (
        "bf16" in flags and "asimd" in flags)  # x86 / Arm names of bf16 dot products
    assert cd.auto_dtype() == (torch.bfloat16 if native_bf16 else torch.float32)
    assert cd.describe(torch.float32).startswith(f"compute dtype float32 (CPU {cd.cpu_class()}")


@pytest.mark.parametrize("command", [["generate", "ck", "--prompt", "x"],
                                     ["eval", "ck", "--base", "b", "--text", "t"],
                                     ["demo"]])
def test_the_cli_takes_dtype_and_defaults_to_auto(command):
    parser = build_parser()
    assert parser.parse_args(command).dtype == "auto"
    assert parser.parse_args([*command, "--dtype", "float32"]).dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--dtype", "float16"])


def test_measure_dtype_is_the_api_s_unless_asked():
    """The default is the API's (the CLI passes only what it is given)."""
    from dynquant.api import MeasureOptions, QuantizeRequest
    from dynquant.cli import measure_options, quantize_options

    parser = build_parser()
    assert "dtype" not in measure_options(parser.parse_args(["measure", "m", "-o", "x"]))
    # (None: float32, or bfloat16 past 2 G quantized weights on a CPU with native bf16)
    assert MeasureOptions().dtype is QuantizeRequest("x").measure.dtype is None
    args = parser.parse_args(["quantize", "m", "-o", "x", "--dtype", "auto"])
    assert quantize_options(args)["measure"].dtype == "auto"
    default = parser.parse_args(["quantize", "m", "-o", "x"])
    assert quantize_options(default)["measure"] == MeasureOptions()


def test_the_measure_passes_take_bf16_only_past_2g_weights_on_native_bf16_cpus(monkeypatch,
                                                                              capsys):
    """``MeasureOptions.dtype`` None: float32 for a model of up to 2 G quantized weights, on a
    CPU without native bf16 products, and for the exact probe; else bfloat16, said in a line."""
    from dynquant.pipeline.measure.options import MeasureOptions
    from dynquant.pipeline.measure.run import _passes_dtype

    big = 50_000 * 40_001  # 2.00005 G quantized weights
    small = 50_000 * 40_000
    fisher = MeasureOptions(method="fisher")
    for flags, want in (({"amx_bf16"}, "bfloat16"), ({"avx512_bf16"}, "bfloat16"),
                        ({"avx2", "fma"}, "float32")):
        monkeypatch.setattr(cd, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert _passes_dtype(fisher, big, False).dtype == want
        assert _passes_dtype(fisher, small, False).dtype == "float32"
        assert _passes_dtype(MeasureOptions(method="kl-exact"), big, False).dtype == "float32"
        assert _passes_dtype(replace(fisher, dtype="float32"), big, False).dtype == "float32"
    monkeypatch.setattr(cd, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    _passes_dtype(fisher, big, True)
    assert "calibration passes in bfloat16: 2.0 G quantized weights" in capsys.readouterr().err


def test_the_codes_dtype_is_the_api_s_unless_asked():
    """``--codes-dtype``: auto leaves the API's default (decided by the model's size and the
    CPU, ``size_dtype``); float32 / bfloat16 are passed on; anything else is refused."""
    from dynquant.api import CodeOptions, ScaleTuning
    from dynquant.cli import quantize_options
    from dynquant.errors import DynquantError

    parser = build_parser()
    default = parser.parse_args(["quantize", "m", "-o", "x"])
    assert quantize_options(default)["codes"].dtype is None is CodeOptions().dtype
    for dtype in ("float32", "bfloat16"):
        args = parser.parse_args(["quantize", "m", "-o", "x", "--codes-dtype", dtype])
        assert quantize_options(args)["codes"].dtype == dtype
    with pytest.raises(SystemExit):
        parser.parse_args(["quantize", "m", "-o", "x", "--codes-dtype", "float16"])
    with pytest.raises(DynquantError, match=r"codes\.dtype"):
        CodeOptions(dtype="float16")
    with pytest.raises(DynquantError, match="--codes-dtype float32"):  # before any work
        CodeOptions(dtype="bfloat16", tuning=ScaleTuning(dtype="float32"))


def test_load_and_from_pretrained_follow_the_decision(tiny_checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM

    import dynquant  # noqa: F401  (registers with transformers)
    from dynquant.format.layout import LayerLayout
    from dynquant.runtime.loader import load
    from dynquant.runtime.packed_modules import PackedWeight, QuantLinear
    from dynquant.runtime.stored_linear import StoredLinear

    checkpoint = tiny_checkpoint("tiny", 4)

    def dtypes(model):
        """The compute dtypes of the packed modules and the dense parameters, but for the
        weights held as the file stores them (StoredLinear: bf16 in a float32 model)."""
        packed = {m.compute_dtype for m in model.modules() if isinstance(m, PackedWeight)}
        stored = {id(m.weight) for m in model.modules() if isinstance(m, StoredLinear)}
        assert all(m.weight.dtype == torch.bfloat16 for m in model.modules()
                   if isinstance(m, StoredLinear))
        dense = {p.dtype for p in model.parameters() if p.is_floating_point()
                 and id(p) not in stored}
        return packed | dense

    for forced in ("float32", "bfloat16"):  # what auto answers on a CPU with / without bf16
        monkeypatch.setenv("DYNQUANT_DTYPE", forced)
        want = cd.DTYPE_NAMES[forced]
        assert dtypes(load(checkpoint)) == {want}
        for kwargs in ({}, {"dtype": "auto"}, {"torch_dtype": "auto"}):
            assert dtypes(AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)) == {want}
        # 4-bit Linears take torch's int4 kernel only in bf16 (float32 activations: 20x slower)
        layout = LayerLayout.create((192, 512), 4, 128)
        assert QuantLinear(layout, compute_dtype=want).use_int4 == (forced == "bfloat16")
    monkeypatch.setenv("DYNQUANT_DTYPE", "bfloat16")
    explicit = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    assert dtypes(explicit) == {torch.float32}  # an explicit dtype is used as given
