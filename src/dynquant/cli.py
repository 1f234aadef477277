"""The ``dynquant`` command line: a thin layer over the Python API.

Errors that come from bad input are printed in one line (no traceback) and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dynquant.errors import DynquantError
from dynquant.format.jsonstyle import dumps

EXIT_INVALID = 1
EXIT_ERROR = 2


def _api():
    """The API, imported when a command needs it (plan, inspect and validate stay light: the
    format layer alone)."""
    from dynquant import api

    return api


def _given(**options) -> dict:
    """The options the user gave (the rest take the API's defaults, defined once there)."""
    return {k: v for k, v in options.items() if v is not None}


def _print_forecast(f) -> None:
    for line in f.lines():
        print(line, file=sys.stderr)


def _cmd_plan(args: argparse.Namespace) -> int:
    from dynquant.format.summary import render_summary

    doc = _api().plan(args.model, args.widths, report=_print_forecast,
                      **_given(group_size=args.group_size))
    if args.json:
        print(dumps(doc))
    else:
        render_summary(doc, f"plan: {args.model} with widths from {args.widths}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from dynquant.format.metadata import METADATA_FILE
    from dynquant.format.summary import render_summary
    from dynquant.format.validate import load_metadata, validate_metadata

    path = Path(args.checkpoint)
    meta = path / METADATA_FILE if path.is_dir() else path
    doc = load_metadata(str(meta))
    problems = validate_metadata(doc, str(meta))
    if problems:
        raise problems[0]
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        render_summary(doc, f"checkpoint: {args.checkpoint}")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from dynquant.format.validate import validate_checkpoint

    problems = validate_checkpoint(args.checkpoint)
    for p in problems:
        print(f"invalid: {one_line(str(p))}", file=sys.stderr)
    if problems:
        return EXIT_INVALID
    print(f"{args.checkpoint}: valid")
    return 0


def quantize_options(args: argparse.Namespace, report=None) -> dict:
    """``dynquant quantize``'s arguments as ``api.quantize``'s configuration sections (each with
    the options given; the rest keep the defaults the API's configurations define)."""
    api = _api()
    return {
        "measure": api.MeasureOptions.of(**_given(
            calib=args.calib or None, calib_seqs=args.calib_seqs, calib_len=args.calib_len,
            method=_method(args), dtype=args.dtype, not_convert=args.not_convert or None)),
        "allocation": api.AllocationOptions(**_given(
            widths=args.widths, budget=args.budget, uniform=args.uniform,
            group_size=args.group_size, group_sizes=_ints(args.group_sizes),
            pins=args.pin or None, min_bits=args.min_bits, max_bits=args.max_bits)),
        "codes": api.CodeOptions(**_given(
            quantizer=args.quantizer, gptq_seqs=args.gptq_seqs, tuning=_tuning(args),
            end_to_end=_end_to_end(args), independent_blocks=args.independent_blocks or None,
            chain_blocks=args.chain_blocks, float_targets=args.float_targets,
            dtype=None if args.codes_dtype == "auto" else args.codes_dtype)),
        "run": api.RunOptions(**_executor(args), progress=not (args.quiet or args.json),
                              report=report),
        **_given(random_init=args.random_init or None, seed=args.seed,
                 overwrite=args.overwrite or None)}


def _cmd_quantize(args: argparse.Namespace) -> int:
    from dynquant.format.summary import render_element_counts, render_summary

    api = _api()
    forecasts = []

    def report(f) -> None:  # before any weight is written: the user can still stop
        forecasts.append(f)
        for line in [] if args.json else f.lines():
            if not args.quiet or line.startswith("warning"):  # --quiet keeps warnings
                print(line, file=sys.stderr)

    doc = api.quantize(args.model, args.output, **quantize_options(args, report))
    if args.json:
        print(json.dumps({"output": args.output, "accounting": doc["accounting"],
                          "provenance": doc["provenance"],
                          "forecast": forecasts[0].to_json() if forecasts else None}, indent=1))
    elif not args.quiet:
        render_summary(doc, f"quantized {args.model} -> {args.output}")
        render_element_counts(api.model(args.model).tensor_specs(), set(doc["layers"]))
    return 0


def _ints(text: str | None) -> list[int] | None:
    return None if text is None else [int(x) for x in text.split(",") if x]


def measure_options(args: argparse.Namespace) -> dict:
    """``dynquant measure``'s arguments as ``api.measure``'s options (those given; the command
    checks its forecast unless told not to)."""
    return _given(
        widths=_ints(args.widths), group_sizes=_ints(args.group_sizes),
        budgets=None if args.budgets is None else [float(b) for b in args.budgets.split(",")
                                                  if b],
        method=_method(args), calib=args.calib or None, not_convert=args.not_convert or None,
        calib_seqs=args.calib_seqs, calib_len=args.calib_len,
        dtype=args.dtype, second_moments=args.second_moments or None,
        moment_seqs=args.moment_seqs, quantizer=args.quantizer, fisher_draws=args.fisher_draws,
        forecast_check=not args.no_forecast_check, check_codes=args.check_codes,
        tuning=_tuning(args))


def _cmd_measure(args: argparse.Namespace) -> int:
    api = _api()
    doc = api.measure(args.model, args.output, progress=not (args.json or args.quiet),
                      random_init=args.random_init, **_executor(args), **measure_options(args))
    summary, lines = api.measure_lines(doc)
    if args.json:
        print(json.dumps({"maps": args.output, **summary}, indent=1))
        return 0
    for line in [] if args.quiet else lines:
        print(line)
    print(f"maps: {args.output}")
    return 0


def _executor(args: argparse.Namespace) -> dict:
    """``--ray [ADDRESS]`` as the executor's name and address."""
    if args.ray is None:
        return {}
    return {"executor": "ray", "address": None if args.ray == "local" else args.ray}


def _work_options(p: argparse.ArgumentParser) -> None:
    """How measure's and quantize's work runs: the calibration passes' dtype, and where."""
    _dtype_option(p, None, "the measure's calibration passes", "default float32, except "
                  "bfloat16 for models past 2 G quantized weights on a CPU with native bf16 "
                  "products (not for --method kl-exact: bf16 noise is of the size of its "
                  "sensitivities); the codes' pass: --codes-dtype")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run the per-module work as Ray tasks: on the cluster at ADDRESS (auto, "
                   "ray://HOST:10001), or without one on a Ray instance started on this "
                   "machine's cores; the model folder must be at the same path on every worker "
                   "(pip install 'dynquant[ray]'; output byte-identical to a run without)")


def _method(args: argparse.Namespace) -> str | None:
    if not args.no_calib:
        return args.method
    if args.calib or args.method not in (None, "weight"):
        raise DynquantError("--no-calib is the data-free path: it takes no --calib or --method",
                            field="no-calib")
    return "weight"


def _cmd_allocate(args: argparse.Namespace) -> int:
    api = _api()
    alloc = api.allocate(args.maps, args.budget, uniform=args.uniform, pins=args.pin,
                         min_bits=args.min_bits, max_bits=args.max_bits,
                         group_sizes=_ints(args.group_sizes))
    text = json.dumps(api.widths_json(alloc, args.maps), indent=1) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    print(f"{alloc.average_bits} bits per weight, {alloc.packed_nbytes:,} packed bytes, "
          f"predicted error {alloc.predicted_error:.6g}", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    _api().generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, seed=args.seed, dtype=args.dtype,
                    chat=args.chat, activations=args.activations)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from dynquant.numerics.compute_dtype import describe, resolve_dtype

    dtype = resolve_dtype(args.dtype)
    print(f"[{describe(dtype)}]", file=sys.stderr)
    result = _api().evaluate(args.model, args.base, args.text, ctx=args.ctx,
                             max_tokens=args.max_tokens, progress=not args.json, dtype=dtype,
                             activations=args.activations, spread=args.spread)
    if args.json:
        print(result.to_json())
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{args.model} vs base {args.base} ({result.tokens:,} tokens)",
                      title_justify="left")
        for col in ("PPL", "base PPL", "delta PPL", "KL mean", "KL median", "KL p99", "top-1"):
            table.add_column(col, justify="right")
        table.add_row(f"{result.ppl_model:.3f}", f"{result.ppl_base:.3f}",
                      f"{result.delta_ppl:+.3f}", f"{result.kl_mean:.5f}",
                      f"{result.kl_median:.5f}", f"{result.kl_p99:.5f}",
                      f"{result.top1_agreement:.4f}")
        Console().print(table)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    _api().demo(args.output, dtype=args.dtype)
    return 0


DTYPE_CHOICES = ("auto", "bfloat16", "float32")


def _activations_option(p: argparse.ArgumentParser, what: str) -> None:
    from dynquant.runtime.activations import CHOICES

    p.add_argument("--activations", choices=CHOICES, default="auto",
                   help=f"activations of {what}: int8 (integer dot products on the codes), "
                   "float (float32), or auto: $DYNQUANT_ACTIVATIONS, else int8 for modules of "
                   "4+ bits and int16 for narrower ones where the CPU has VNNI or AVX2")


def _dtype_option(p: argparse.ArgumentParser, default: str | None, what: str,
                  said: str | None = None) -> None:
    """``--dtype``; ``said``: what the help says of the default (that ``default`` names, when
    the API's default applies)."""
    said = f"default {default}; " if said is None else f"{said}; "
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=default,
                   help=f"compute dtype of {what} ({said}auto: bfloat16 only where "
                   "the CPU has native bf16 dot products, else float32; $DYNQUANT_DTYPE sets auto's "
                   "answer)")


def _model_options(p: argparse.ArgumentParser) -> None:
    """What measure and quantize share about the model and their output."""
    p.add_argument("--not-convert", action="append", default=[], metavar="GLOB",
                   help="keep matching modules dense (modules_to_not_convert; not measured); "
                   "repeatable")
    p.add_argument("--random-init", action="store_true",
                   help="i.i.d. Gaussian weights, generated module by module (presets): "
                   "data-free only")
    p.add_argument("--quiet", action="store_true",
                   help="no progress, forecast or summary (warnings still print)")


def _calibration_options(p: argparse.ArgumentParser) -> None:
    """The calibration text and the sensitivities (measure and quantize)."""
    p.add_argument("--calib", action="append", default=[],
                   help="calibration text file(s) (default: the English text dynquant ships)")
    p.add_argument("--calib-seqs", type=int,
                   help="calibration sequences for the statistics and sensitivities (default 8; "
                   "cost: linear in them)")
    p.add_argument("--calib-len", type=int,
                   help="tokens per calibration sequence (default 256)")
    p.add_argument("--method", choices=("weight", "fisher", "kl-exact", "kl"),
                   help="sensitivities: fisher (the default: streamed, one forward and one "
                   "backward pass), kl-exact (one full forward per module; 'kl' is its old "
                   "name), weight (data-free priors by role and depth; = --no-calib)")
    p.add_argument("--no-calib", action="store_true",
                   help="data-free sensitivities (no text, no loss prediction); without it and "
                   "without --calib, dynquant calibrates on the English text it ships")
    p.add_argument("--json", action="store_true",
                   help="print the result (sizes, predicted KL per budget, warnings) as JSON")
    p.add_argument("--tune-steps", type=int,
                   help="tuned codes (the default with text): scale-tuning steps per block, one "
                   "calibration window each (default 100); measure: those its forecast check "
                   "writes")
    p.add_argument("--tune-rounding", type=float, metavar="STEP",
                   help="tuned codes: Adam's step in codes on each weight's rounding, tuned "
                   "with the scales (a code moves by one at most from GPTQ's); default 6e-3 for "
                   "a model of up to 2 G quantized weights (SmolLM2-135M 2-4%% less KL than "
                   "3e-3, the same time), 3e-3 past it (6e-3 holds ~0.9 GiB more at 7B shapes: "
                   "BENCHMARKS.md \"Tuned scales\"); 0: GPTQ's codes, only the scales and "
                   "offsets tuned (less time and memory while a block is tuned)")
    p.add_argument("--tune-dtype", choices=("auto", "float32", "bfloat16"),
                   help="tuned codes: the tuning steps' products in float32 or bfloat16 (where "
                   "the CPU multiplies bf16 natively, e.g. AMX or AVX-512 BF16: 0.4-0.6x the "
                   "time at 7B shapes for 2-3%% more KL, BENCHMARKS.md \"Scale\"; far slower "
                   "on AVX2-only CPUs); auto (the default): the codes' pass's (--codes-dtype: "
                   "on a bfloat16 pass the steps are bfloat16)")
    p.add_argument("--tune-error", choices=("gains", "plain"),
                   help="tuned codes: the block's output error fitted: gains (the default: each "
                   "channel times the gain of the norm that reads the block's output) or plain "
                   "(the squared difference, which the residual stream's largest channels "
                   "dominate: Gemma-3-270M at 4.25 bits 8%% more KL)")
    p.add_argument("--tune-on", choices=("quantized", "float"),
                   help="tuned codes: the hidden states each block is fitted on: quantized (the "
                   "default: the model being quantized, each block correcting the ones before "
                   "it, one block after the other) or float (the float model's: every block's "
                   "tuning a job of its own beside the GPTQ pass, for a cluster; a little less "
                   "accurate)")


def _tuning(args: argparse.Namespace):
    """The tuned codes' settings asked for (None: the API's, unless --tune-steps / --tune-on /
    --tune-rounding / --tune-dtype / --tune-error)."""
    given = {"steps": args.tune_steps, "inputs": args.tune_on, "rounding": args.tune_rounding,
             "dtype": None if args.tune_dtype == "auto" else args.tune_dtype,
             "error": args.tune_error}
    if all(v is None for v in given.values()):
        return None
    return _api().ScaleTuning(**{k: v for k, v in given.items() if v is not None})


def _end_to_end(args: argparse.Namespace):
    """The end-to-end tuning asked for (None: the API's default, ``EndToEndTuning.resolved``)."""
    return None if args.e2e_steps is None else _api().EndToEndTuning(steps=args.e2e_steps)


def _constraint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pin", action="append", default=[], metavar="GLOB=BITS",
                   help="fix the width of matching modules, e.g. 'model.embed_tokens=8'; "
                   "repeatable")
    p.add_argument("--min-bits", type=int, help="no module narrower than this")
    p.add_argument("--max-bits", type=int, help="no module wider than this")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predicted layers table and accounting, touching no weight")
    p.add_argument("model", help="model directory, config.json, preset (seed, tiny, small), or hub "
                   "name in the local Hugging Face cache")
    p.add_argument("--widths", required=True,
                   help="dynquant.json, widths JSON {module: bits}, or MAPS.json:BUDGET (allocated "
                   "from the maps, its predicted KL printed)")
    p.add_argument("--group-size", type=int,
                   help="weights per scale/offset pair where --widths gives bare widths "
                   "(default 128)")
    p.add_argument("--json", action="store_true", help="print the predicted dynquant.json")
    p.set_defaults(func=_cmd_plan)


def _add_measure(sub) -> None:
    p = sub.add_parser("measure", help="errors and sensitivities per module -> maps.json")
    p.add_argument("model", help="model directory, config.json, preset, or hub name (org/name[@rev]) "
                   "already in the local Hugging Face cache")
    p.add_argument("-o", "--output", required=True,
                   help="maps.json to write (statistics beside it; a killed run resumes)")
    _calibration_options(p)
    p.add_argument("--widths", help="candidate widths per module (default 2,3,4,8)")
    p.add_argument("--group-sizes",
                   help="candidate group sizes (default 64,128 for a model of up to 2 G quantized "
                   "weights, 128 past it; each one more set of candidates)")
    p.add_argument("--budgets", help="budgets (average bits) pre-allocated into maps.json "
                   "(default 2.5,3,3.25,3.5,4.25)")
    _model_options(p)
    p.add_argument("--fisher-draws", type=int,
                   help="label draws per sequence for --method fisher (noise ~ sqrt(2 / "
                   "(sequences x draws)); each costs one backward pass)")
    p.add_argument("--second-moments", action="store_true",
                   help="also write each Linear's X^T X / tokens (of the float model) to "
                   "OUTPUT_STEM.moments/ (what measure --quantizer gptq prices with)")
    p.add_argument("--quantizer", choices=("rtn", "gptq"),
                   help="the quantizer the candidates are priced with: rtn (default, with each "
                   "Linear's gptq ratio; what quantize uses with any --quantizer), gptq (each "
                   "candidate width compensated on the float model's inputs: a slower measure "
                   "whose allocations measure the same, BENCHMARKS.md 'Error-compensating "
                   "codes'; implies --second-moments)")
    p.add_argument("--moment-seqs", type=int,
                   help="calibration sequences for the measure's second moments (default 16: "
                   "the gptq ratios price as well as from 48; a forward-only pass of its own)")
    p.add_argument("--no-forecast-check", action="store_true",
                   help="skip the check of the forecast (two checkpoints allocated at the probe "
                   "width's bytes and one bit per weight more, measured on held-out windows of "
                   "the text, about one quantize's time with gptq codes); forecasts are then "
                   "sums over modules")
    p.add_argument("--check-codes", choices=("gptq", "tuned"), default=None,
                   help="the codes the check writes (default gptq: its forecast bounds the "
                   "tuned codes' from above, at about a quarter of a tuned check's time; tuned "
                   "checks the default codes themselves)")
    _work_options(p)
    p.set_defaults(func=_cmd_measure)


def _add_allocate(sub) -> None:
    p = sub.add_parser("allocate", help="widths for a budget from maps.json (exact optimum)")
    p.add_argument("maps", help="maps.json of dynquant measure")
    p.add_argument("--budget", type=float,
                   help="average bits per weight, scale overhead counted (exact MILP, HiGHS)")
    p.add_argument("--uniform", type=int, help="every module at this width instead")
    p.add_argument("--group-sizes", help="group sizes allowed, e.g. 64,128 (default: all measured)")
    _constraint_options(p)
    p.add_argument("-o", "--output", help="widths JSON to write (default: print it)")
    p.set_defaults(func=_cmd_allocate)


def _add_quantize(sub) -> None:
    p = sub.add_parser("quantize", help="(measure ->) allocate -> quantize -> write")
    p.add_argument("model", help="model directory, config.json, preset, or hub name (org/name[@rev]) "
                   "already in the local Hugging Face cache")
    p.add_argument("-o", "--output", required=True,
                   help="checkpoint directory to write (atomically; a killed run resumes)")
    p.add_argument("--widths", help="maps.json[:BUDGET] | dynquant.json | widths.json")
    p.add_argument("--budget", type=float, help="average bits per weight (scale overhead counted)")
    p.add_argument("--uniform", type=int, help="every module at this width (for comparison)")
    _calibration_options(p)
    p.add_argument("--group-size", type=int,
                   help="weights per scale/offset pair, one for every module (smaller: more "
                   "accurate, 0.25 bits per weight more per halving); default: at a budget the "
                   "allocator's choice among the measure's sizes (64 and 128 for a model of up "
                   "to 2 G quantized weights, else 128), uniform widths 128")
    p.add_argument("--group-sizes", help="allocate group sizes too, e.g. 32,64,128")
    p.add_argument("--quantizer", choices=("auto", "rtn", "gptq", "tuned"),
                   help="how codes are chosen: gptq (error-compensating, block by block over "
                   "the quantized model's own activations on --gptq-seqs calibration windows; "
                   "Linears, expert banks and the output head; an untied input embedding rtn), "
                   "tuned (gptq's codes, then each block's group scales and offsets tuned "
                   "against the float block, then, up to 2 G quantized weights, every scale "
                   "against the float model (--e2e-steps): lower KL for a longer quantize, "
                   "BENCHMARKS.md 'Tuned scales'), rtn (round-to-nearest with a clip search), auto (default: "
                   "tuned when calibrating on text, rtn data-free)")
    p.add_argument("--gptq-seqs", type=int,
                   help="calibration windows the gptq pass streams (default 48 x --calib-len "
                   "tokens; cost: about one forward per Linear group over them)")
    p.add_argument("--independent-blocks", action="store_true",
                   help="gptq and tuned codes: every block's from the float model's hidden states "
                   "instead of the quantized model's (its scales tuned on them too), so that no "
                   "block waits for another: with --ray each block is a job of its own (a much "
                   "shorter run on a cluster for more KL: docs/distributed.md); "
                   "--chain-blocks 1")
    p.add_argument("--chain-blocks", type=int, metavar="K",
                   help="gptq and tuned codes: the blocks in chains of K, each chain's from the "
                   "float model's hidden states at its first block, so that no chain waits for "
                   "another: with --ray each chain is a job of its own (between the default, "
                   "one chain of every block, and --independent-blocks in time on a cluster and "
                   "in KL: BENCHMARKS.md 'Tuned scales', docs/distributed.md)")
    p.add_argument("--float-targets", type=float, nargs="?", const=0.5, metavar="FRACTION",
                   help="gptq and tuned codes: GPTAQ (GPTQModel's v2), each Linear's codes "
                   "fitted to the float model's outputs from the quantized model's inputs, "
                   "the shift taken by FRACTION (GPTQModel's alpha: 0.5 when none is given, "
                   "the best of 0.25 / 0.5 / 1 on SmolLM2 and Gemma-3; 1: the whole way; 0: "
                   "plain GPTQ): lower KL for --quantizer gptq (0.73-0.92x), 1-4%% lower for "
                   "the tuned codes, for a float forward of every block and a product of each "
                   "weight with the windows more. Default: 0.5 for the tuned codes of a model "
                   "of at most 2 G quantized weights, else 0 (BENCHMARKS.md 'Error-compensating "
                   "codes', 'Tuned scales')")
    p.add_argument("--codes-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="gptq and tuned codes: the pass's compute dtype (its blocks' forwards, "
                   "so the second moments' inputs, and the tuning steps): auto (the default) "
                   "bfloat16 for models past 2 G quantized weights on a CPU with native bf16 "
                   "products (AMX, AVX-512 BF16: about half the pass's time at 7B shapes, "
                   "BENCHMARKS.md 'Scale'), else float32 (and under --tune-dtype float32)")
    p.add_argument("--e2e-steps", type=int,
                   help="gptq / tuned codes: then every group scale and offset tuned against "
                   "the float model's next-token distributions, one calibration window a step "
                   "(default: 40 for tuned codes of a model with at most 2 G quantized "
                   "weights, else 0: off; 40 steps took Gemma-3-270M's KL 13%% lower for a "
                   "third to three quarters of the quantize's time again: BENCHMARKS.md "
                   "'Tuned scales')")
    _constraint_options(p)
    _model_options(p)
    p.add_argument("--seed", type=int, help="seed of --random-init's weights (default 0)")
    p.add_argument("--lm-head", action="store_true",
                   help="quantize an untied lm_head (the default: it is priced and given a width "
                   "like any Linear; --not-convert lm_head keeps it dense)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint at --output")
    _work_options(p)
    p.set_defaults(func=_cmd_quantize)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="summarise a checkpoint or dynquant.json")
    p.add_argument("checkpoint", help="checkpoint directory or a bare dynquant.json")
    p.add_argument("--json", action="store_true", help="print the metadata as JSON")
    p.set_defaults(func=_cmd_inspect)


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="check a checkpoint (exit 1 with one line per problem)")
    p.add_argument("checkpoint", help="checkpoint directory or a bare dynquant.json")
    p.set_defaults(func=_cmd_validate)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity and KL(base || model) on a text")
    p.add_argument("model", help="dynquant checkpoint or transformers model folder")
    p.add_argument("--base", required=True,
                   help="the reference model (checkpoint, folder, or hub name in the local "
                   "Hugging Face cache)")
    p.add_argument("--text", required=True, help="a plain text file")
    p.add_argument("--ctx", type=int, default=512,
                   help="tokens per evaluation window (default 512)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="evaluate at most this many tokens of --text (default: all)")
    p.add_argument("--spread", action="store_true",
                   help="--max-tokens' windows evenly spaced over the whole text instead of "
                   "from its start (a sample of every part of a text that joins sources)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _dtype_option(p, "auto", "both models")
    _activations_option(p, "MODEL's products (int8: every token as decode computes it; BASE "
                        "stays float)")
    p.set_defaults(func=_cmd_eval)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt with a checkpoint (streams tokens)")
    p.add_argument("checkpoint", help="dynquant checkpoint directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is one user turn through the model's chat template "
                   "(instruct models)")
    _dtype_option(p, "auto", "the model")
    _activations_option(p, "the decode products")
    p.set_defaults(func=_cmd_generate)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job on the bundled default")
    p.add_argument("-o", "--output", default="out/demo",
                   help="where the checkpoints, table and plot go (default out/demo)")
    _dtype_option(p, "auto", "the evaluations and the sample")
    p.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    from dynquant import __version__

    parser = argparse.ArgumentParser(prog="dynquant", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dynquant {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    # in pipeline order: what --help lists and the README's "Use" follows
    _add_plan(sub)
    _add_measure(sub)
    _add_allocate(sub)
    _add_quantize(sub)
    _add_inspect(sub)
    _add_validate(sub)
    _add_eval(sub)
    _add_generate(sub)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in ("plan", "inspect", "validate"):  # those need no transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress bars say what is happening
    try:
        return args.func(args)
    except (DynquantError, OSError) as exc:
        print(f"dynquant: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR


def one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
