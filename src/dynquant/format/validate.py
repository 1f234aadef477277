"""The one validator of the dynquant_checkpoint_v2 format: metadata, files and tensors.

Every check appends a :class:`CheckpointError` naming file, module and field; nothing raises
half-way, so a user sees every problem at once. Needs no torch: headers are parsed by hand and
scale values are checked through numpy memory maps.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from dynquant.errors import CheckpointError
from dynquant.format import metadata as md
from dynquant.format.layout import LayerLayout, tensor_names
from dynquant.format.safetensors_header import TensorInfo, bf16_nonfinite_count, read_header
from dynquant.format.widths import SUPPORTED_GROUP_SIZES

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
Problems = list[CheckpointError]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


class _Checker:
    """Collects problems for one document; ``expect`` records a failed condition."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: Problems = []

    def add(self, message: str, module: str | None = None, field: str | None = None) -> None:
        self.problems.append(CheckpointError(message, file=self.file, module=module, field=field))

    def expect(self, ok: bool, message: str, module: str | None, field: str) -> bool:
        if not ok:
            self.add(message, module, field)
        return ok

    def typed(self, obj: dict, key: str, check: Callable[[Any], bool], what: str,
              module: str | None = None) -> bool:
        ok = key in obj and check(obj[key])
        value = repr(obj[key]) if key in obj else "missing"
        return self.expect(ok, f"must be {what}, got {value}", module, key)


def _check_layer(c: _Checker, name: str, e: Any) -> LayerLayout | None:
    if not c.expect(isinstance(e, dict), "layer entry must be an object", name, "layers"):
        return None
    oks = [
        c.typed(e, "bits", _is_int, "an integer", name),
        c.typed(e, "group_size", _is_int, "an integer", name),
        c.typed(e, "logical_shape", lambda v: isinstance(v, list), "a list", name),
    ]
    if not all(oks):
        return None
    try:
        lay = LayerLayout.create(e["logical_shape"], e["bits"], e["group_size"], module=name)
    except CheckpointError as exc:
        c.add(exc.message, name, exc.field)
        return None
    except Exception as exc:  # unsupported bits / group size
        c.add(str(getattr(exc, "message", exc)), name, getattr(exc, "field", None))
        return None
    derived = lay.entry()
    for key in ("in_features", "num_rows", "num_groups", "words_per_group", "row_offset",
                "layout", "symmetric", "has_offsets", "nbytes", "bits_per_weight"):
        c.expect(key in e and e[key] == derived[key] and type(e[key]) is type(derived[key]),
                 f"is {e.get(key, 'missing')!r}, the layout gives {derived[key]!r}", name, key)
    c.expect(e.get("compute_dtype") in COMPUTE_DTYPES,
             f"must be one of {', '.join(COMPUTE_DTYPES)}", name, "compute_dtype")
    for key in ("clipped_fraction", "clip_improvement"):
        v = e.get(key)
        c.expect(v is None or (_is_num(v) and -1.0 <= v <= 1.0),
                 f"must be null or a number in [-1, 1], got {v!r}", name, key)
    unknown = sorted(set(e) - set(derived))
    c.expect(not unknown, f"unknown fields {unknown}", name, "layers")
    return lay


def _check_files(c: _Checker, files: Any) -> None:
    if not c.expect(isinstance(files, list) and len(files) > 0 and
                    all(isinstance(f, str) for f in files),
                    "must be a non-empty list of file names", None, "files"):
        return
    for f in files:
        p = PurePosixPath(f)
        safe = (not p.is_absolute() and ".." not in p.parts and "\\" not in f and ":" not in f
                and f.endswith(".safetensors") and p.name == f.split("/")[-1] and f.strip() == f)
        c.expect(safe, f"{f!r} is not a plain relative .safetensors path inside the checkpoint",
                 None, "files")
    c.expect(len(set(files)) == len(files), "lists a file twice", None, "files")


def _check_qconfig(c: _Checker, qc: Any, layers: dict[str, LayerLayout]) -> None:
    if not c.expect(isinstance(qc, dict), "must be an object", None, "quantization_config"):
        return
    for key, want in (("quant_method", md.QUANT_METHOD),
                      ("checkpoint_format", md.CHECKPOINT_FORMAT),
                      ("schema_version", md.SCHEMA_VERSION), ("symmetric", False)):
        c.expect(qc.get(key) == want, f"must be {want!r}, got {qc.get(key)!r}",
                 "quantization_config", key)
    c.typed(qc, "group_size", lambda v: _is_int(v) and v in SUPPORTED_GROUP_SIZES,
            f"one of {SUPPORTED_GROUP_SIZES}", "quantization_config")
    c.typed(qc, "lm_head_quantized", lambda v: isinstance(v, bool), "a boolean",
            "quantization_config")
    c.typed(qc, "modules_to_not_convert",
            lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
            "a list of names", "quantization_config")
    mods = qc.get("modules")
    if not c.expect(isinstance(mods, dict), "must be an object", "quantization_config", "modules"):
        return
    c.expect(list(mods) == sorted(mods), "keys must be sorted", "quantization_config", "modules")
    for name in sorted(set(mods) ^ set(layers)):
        c.add("listed in only one of quantization_config.modules and layers", name, "modules")
    for name, lay in layers.items():
        m = mods.get(name)
        if not isinstance(m, dict):
            continue
        c.expect(m.get("bits") == lay.bits, f"bits {m.get('bits')!r} != layer's {lay.bits}",
                 name, "modules.bits")
        c.expect(m.get("out_features") == lay.num_rows,
                 f"out_features {m.get('out_features')!r} != num_rows {lay.num_rows}",
                 name, "modules.out_features")
        c.expect(m.get("group_size", qc.get("group_size")) == lay.group_size,
                 "group size disagrees with the layer's", name, "modules.group_size")


def _check_accounting(c: _Checker, acc: Any, layers: dict[str, dict]) -> None:
    if not c.expect(isinstance(acc, dict), "must be an object", None, "accounting"):
        return
    if not c.typed(acc, "dense_nbytes", lambda v: _is_int(v) and v >= 0,
                   "a non-negative integer", "accounting"):
        return
    want = md.accounting(layers, acc["dense_nbytes"])
    for key, value in want.items():
        c.expect(acc.get(key) == value, f"is {acc.get(key)!r}, the layers give {value!r}",
                 "accounting", key)


def validate_metadata(doc: Any, file: str = md.METADATA_FILE) -> Problems:
    """Every problem of a dynquant.json document, checked without any tensor file."""
    c = _Checker(file)
    if not c.expect(isinstance(doc, dict), "metadata must be a JSON object", None, "document"):
        return c.problems
    if not c.expect(doc.get("schema") == md.SCHEMA,
                    f"unknown schema {doc.get('schema')!r} (expected {md.SCHEMA!r})",
                    None, "schema"):
        return c.problems
    raw_layers = doc.get("layers")
    if not c.expect(isinstance(raw_layers, dict), "must be an object", None, "layers"):
        return c.problems
    c.expect(list(raw_layers) == sorted(raw_layers), "keys must be sorted", None, "layers")
    layouts = {n: lay for n, e in raw_layers.items() if (lay := _check_layer(c, n, e))}
    _check_qconfig(c, doc.get("quantization_config"), layouts)
    _check_files(c, doc.get("files"))
    good = {n: raw_layers[n] for n in layouts}
    if len(good) == len(raw_layers):
        _check_accounting(c, doc.get("accounting"), good)
    banks = sorted(n for n, lay in layouts.items() if lay.is_expert_bank)
    c.expect(doc.get("expert_banks") == banks, "must list exactly the 3-D layers, sorted",
             None, "expert_banks")
    tied = doc.get("tied")
    c.expect(isinstance(tied, dict) and all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in tied.items()),
             "must be an object of name -> name", None, "tied")
    _check_provenance(c, doc.get("provenance"), doc.get("accounting"))
    return c.problems


def _check_provenance(c: _Checker, prov: Any, acc: Any) -> None:
    if not c.expect(isinstance(prov, dict), "must be an object", None, "provenance"):
        return
    c.expect(prov.get("allocator") in (*md.ALLOCATORS, None),
             f"unknown allocator {prov.get('allocator')!r}", "provenance", "allocator")
    pred = prov.get("predicted_nbytes")
    total = acc.get("total_nbytes") if isinstance(acc, dict) else None
    c.expect(pred is None or pred == total,
             f"predicted_nbytes {pred!r} != total_nbytes {total!r}", "provenance",
             "predicted_nbytes")


def load_metadata(path: str) -> dict:
    """Parse a dynquant.json file (no validation); a typed error if it is missing or not JSON."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError as exc:
        raise CheckpointError("no such file", file=path) from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", file=path) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"not valid JSON ({exc})", file=path, field="document") from exc


def _check_tensor(c: _Checker, info: TensorInfo | None, module: str, what: str,
                  dtype: str, shape: tuple[int, ...]) -> None:
    if not c.expect(info is not None, f"tensor {module}.{what} is missing", module, what):
        return
    c.expect(info.dtype == dtype, f"dtype {info.dtype}, expected {dtype}", module, what)
    c.expect(info.shape == shape, f"shape {list(info.shape)}, expected {list(shape)}",
             module, what)
    if what != "qweight" and info.dtype == "BF16" and info.shape == shape:
        bad = bf16_nonfinite_count(info)
        c.expect(bad == 0, f"{bad} NaN/Inf values", module, what)


def _read_tensors(c: _Checker, root: str, files: list[str]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        path = os.path.join(root, f)
        try:
            header = read_header(path)
        except CheckpointError as exc:
            c.problems.append(exc)
            continue
        for name, info in header.items():
            if name in tensors:
                c.add(f"tensor stored twice ({tensors[name].file})", name, "files")
            tensors[name] = info
    return tensors


def validate_checkpoint(path: str) -> Problems:
    """Every problem of a checkpoint directory (or of a bare metadata JSON file)."""
    return read_checkpoint(path)[2]


def read_checkpoint(path: str) -> tuple[dict | None, dict[str, TensorInfo], Problems]:
    """A checkpoint's metadata, every tensor's place (each file's header parsed once), and
    every problem: what both ``validate`` and a reader need."""
    if not os.path.isdir(path):
        try:
            doc = load_metadata(path)
        except CheckpointError as exc:
            return None, {}, [exc]
        return doc, {}, validate_metadata(doc, path)
    meta_path = os.path.join(path, md.METADATA_FILE)
    try:
        doc = load_metadata(meta_path)
    except CheckpointError as exc:
        return None, {}, [exc]
    problems = validate_metadata(doc, meta_path)
    if problems:
        return doc, {}, problems  # tensor checks need a sound document
    c = _Checker(meta_path)
    tensors = _read_tensors(c, path, doc["files"])
    if c.problems:
        return doc, tensors, c.problems
    quantized: set[str] = set()
    for name, e in doc["layers"].items():
        lay = LayerLayout.create(e["logical_shape"], e["bits"], e["group_size"])
        q, s, o = tensor_names(name)
        quantized |= {q, s, o}
        _check_tensor(c, tensors.get(q), name, "qweight", "I32", lay.qweight_shape)
        _check_tensor(c, tensors.get(s), name, "scales", "BF16", lay.scales_shape)
        _check_tensor(c, tensors.get(o), name, "offsets", "BF16", lay.scales_shape)
    dense = sum(info.nbytes for n, info in tensors.items() if n not in quantized)
    c.expect(dense == doc["accounting"]["dense_nbytes"],
             f"dense tensors hold {dense} bytes, accounting says "
             f"{doc['accounting']['dense_nbytes']}", "accounting", "dense_nbytes")
    _check_config(c, path, doc)
    return doc, tensors, c.problems


def _check_config(c: _Checker, root: str, doc: dict) -> None:
    cfg_path = os.path.join(root, md.CONFIG_FILE)
    try:
        cfg = load_metadata(cfg_path)
    except CheckpointError as exc:
        c.problems.append(exc)
        return
    c.expect(isinstance(cfg, dict) and cfg.get("quantization_config") == doc[
        "quantization_config"], "quantization_config differs from dynquant.json's",
        md.CONFIG_FILE, "quantization_config")
