"""Registering dynquant with transformers when transformers is imported, not before.

After ``import dynquant``, transformers' Auto classes must know the reference architecture and
``AutoModelForCausalLM.from_pretrained`` must load dynquant checkpoints. Registering needs
transformers (and torch) imported, 3-5 s that commands such as ``dynquant validate`` (numpy
only) should not pay. So ``import dynquant`` registers at once if transformers is already
imported, and otherwise installs a one-shot import hook that registers right after transformers'
own ``__init__`` has run, before the importing code gets the module back.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType


def register_now() -> None:
    from dynquant.models.registration import register as register_models
    from dynquant.runtime.hf_integration import register_with_transformers

    register_models()
    register_with_transformers()


class _RegisteringLoader(importlib.abc.Loader):
    """transformers' own loader, followed by our registration."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        try:
            register_now()
        except Exception as exc:  # transformers must import even if our registration fails
            warnings.warn(f"dynquant: could not register with transformers: {exc}",
                          RuntimeWarning, stacklevel=2)


class _TransformersHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; and the real finders must not see us again
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def register_when_transformers_loads() -> None:
    if "transformers" in sys.modules:
        register_now()
    elif not any(isinstance(f, _TransformersHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TransformersHook())


__all__ = ["register_now", "register_when_transformers_loads"]
