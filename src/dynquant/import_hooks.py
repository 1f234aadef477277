"""What dynquant's import hooks share: a module's spec as the other finders would give it, with
its loader wrapped (``autoregister.py``: registering with transformers when it loads;
``blas_kernels.py``: MKL's kernels chosen when torch loads)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType


class DelegatingLoader(importlib.abc.Loader):
    """A module's own loader, whose ``exec_module`` a subclass surrounds with its own work."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> object:  # get_source, is_package, resource readers...
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)


def spec_with_loader(finder: importlib.abc.MetaPathFinder, fullname: str, path: object,
                     target: object, wrap: Callable[[importlib.abc.Loader], importlib.abc.Loader]
                     ) -> importlib.machinery.ModuleSpec | None:
    """``fullname``'s spec from the finders after ``finder`` on ``sys.meta_path`` (None: none
    finds it), its loader wrapped by ``wrap`` where it executes modules."""
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = wrap(spec.loader)
            return spec
    return None


__all__ = ["DelegatingLoader", "spec_with_loader"]
