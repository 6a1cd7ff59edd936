"""A package whose names load on first use from its modules (PEP 562), so that importing it, or
the names that need no torch, does not import what the others need."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any


def lazy_names(
    package: str, where: Mapping[str, str], modules: Collection[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__`: each name of `where` from its module (loaded
    once, then a plain attribute), and each submodule of `modules` as an attribute."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            return importlib.import_module(f"{package}.{name}")
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # once loaded, a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
