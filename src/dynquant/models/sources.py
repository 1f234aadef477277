"""Resolving a MODEL argument: a built-in preset, a model directory, or a config.json."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from dynquant.errors import ModelError
from dynquant.format.planner import TensorSpec
from dynquant.models.disk_layout import conversion_transforms
from dynquant.models.hybrid.configuration import DynquantHybridConfig
from dynquant.models.hybrid.inventory import hybrid_tensor_specs
from dynquant.models.inventory import meta_model, transformers_specs
from dynquant.models.presets import PRESETS, preset_config
from dynquant.models.registration import register


@dataclass
class ModelSource:
    """What a quantization needs to know about a model before reading any weight."""

    name: str  # as the user gave it (recorded in provenance)
    config: PretrainedConfig
    directory: Path | None  # where weights and tokenizer files live, if anywhere

    def tensor_specs(self, lm_head_quantized: bool = True) -> list[TensorSpec]:
        if isinstance(self.config, DynquantHybridConfig):
            return hybrid_tensor_specs(self.config)
        return transformers_specs(self.config, lm_head_quantized)

    def conversion_transforms(self) -> list:
        """How the stored tensors map onto the model's parameters (see models.disk_layout)."""
        if isinstance(self.config, DynquantHybridConfig):
            return []
        return conversion_transforms(meta_model(self.config))

    @property
    def tied(self) -> dict[str, str]:
        if getattr(self.config, "tie_word_embeddings", False):
            return {"lm_head": "model.embed_tokens"}
        return {}


HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.-]+)?$")


def resolve_model(model: str) -> ModelSource:
    """A preset name, a directory holding config.json, a config.json file, or a hub name
    (``org/name[@revision]``) already in the local Hugging Face cache."""
    register()
    path = Path(model)
    if not path.exists():
        if model in PRESETS:
            return ModelSource(model, preset_config(model), None)
        if HUB_NAME.match(model):
            return _from_hub_cache(model)
        raise ModelError(f"no such model directory, config.json or preset "
                         f"(presets: {', '.join(PRESETS)})", file=model)
    directory = path if path.is_dir() else path.parent
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise ModelError("no config.json in the model directory", file=str(path))
    try:
        config = AutoConfig.from_pretrained(str(cfg_file) if path.is_file() else str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise ModelError(f"cannot read the model config ({exc})", file=str(cfg_file)) from exc
    return ModelSource(model, config, directory if os.path.isdir(directory) else None)


def model_folder(name: str | Path) -> Path:
    """A local folder as it is; a hub name ``org/name[@revision]`` (not a local path) as its
    snapshot folder in the local Hugging Face cache (no network)."""
    if Path(name).exists() or not HUB_NAME.match(str(name)):
        return Path(name)
    return _snapshot(str(name))


def _from_hub_cache(name: str) -> ModelSource:
    """``org/name[@revision]`` from the local cache, named ``org/name@COMMIT`` so that
    provenance pins what was quantized."""
    folder = _snapshot(name)
    source = resolve_model(str(folder))
    source.name = f"{name.partition('@')[0]}@{folder.name}"
    return source


def _snapshot(name: str) -> Path:
    """The snapshot folder of that revision (default ``main``), from the cache only."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = name.partition("@")
    home = os.environ.get("HF_HOME")  # read now: huggingface_hub read it at its import
    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(home, "hub") if home else constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo, revision=revision or None, cache_dir=cache,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        raise ModelError(f"not a local path or preset, and not in the Hugging Face cache "
                         f"{cache} (download it first, e.g. `hf download {repo}`)",
                         file=name) from exc
