"""The installed distribution's version: pyproject.toml is the one place it is written."""

from __future__ import annotations

from functools import cache


@cache
def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dynquant")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0.0.0+source"
