"""Names of a package loaded on first use (PEP 562): ``import kl_bench`` and ``import kl_bench.api`` stay
instant (the command line installs its signal handlers before torch loads, and ``kl_bench.estimate``
loads no case kind), and each name imports only the module that defines it."""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_names(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for ``exports`` (name → the submodule, relative
    to ``package``, that defines it). A name is imported once, then kept in the package's namespace."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})
    return __getattr__, __dir__
