"""Registering dynquant with transformers when transformers is imported, not before.

After ``import dynquant``, transformers' Auto classes must know the reference architecture and
``AutoModelForCausalLM.from_pretrained`` must load dynquant checkpoints. Registering needs
transformers (and torch) imported, 3-5 s that commands such as ``dynquant validate`` (numpy
only) should not pay. So ``import dynquant`` registers at once if transformers is already
imported, and otherwise installs an import hook:

- transformers imported by the user: the hook registers right after transformers' ``__init__``
  has run, before the importing code gets the module back;
- transformers imported by one of dynquant's own modules (its first ``from transformers import``):
  registering then would import dynquant modules while that one is half-initialised, so the
  hook waits until the outermost dynquant import in progress has finished.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

from dynquant.import_hooks import DelegatingLoader, spec_with_loader

# Importing these registers nothing by itself; register_now() calls their register functions.
_state = {"depth": 0, "pending": False, "done": False}


def register_now() -> None:
    from dynquant.models.registration import register as register_models
    from dynquant.runtime.hf_integration import register_with_transformers

    register_models()
    register_with_transformers()
    _state["done"] = True


def _register_safely() -> None:
    _state["pending"] = False
    try:
        register_now()
    except Exception as exc:  # the import that triggered this must not fail because of it
        warnings.warn(f"dynquant: could not register with transformers: {exc}", RuntimeWarning,
                      stacklevel=3)


class _WatchingLoader(DelegatingLoader):
    """The real loader of a dynquant module or of transformers, plus the bookkeeping above."""

    def __init__(self, loader: importlib.abc.Loader, is_transformers: bool) -> None:
        super().__init__(loader)
        self.is_transformers = is_transformers

    def exec_module(self, module: ModuleType) -> None:
        if self.is_transformers:
            self.loader.exec_module(module)
            _state["pending"] = not _state["done"]
        else:
            _state["depth"] += 1
            try:
                self.loader.exec_module(module)
            finally:
                _state["depth"] -= 1
        if _state["pending"] and _state["depth"] == 0:
            _register_safely()


class _ImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if _state["done"] or not (fullname == "transformers" or fullname.startswith("dynquant.")):
            return None
        return spec_with_loader(self, fullname, path, target,
                                lambda loader: _WatchingLoader(loader, fullname == "transformers"))


def register_when_transformers_loads() -> None:
    if "transformers" in sys.modules:
        register_now()
    elif not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


__all__ = ["register_now", "register_when_transformers_loads"]
