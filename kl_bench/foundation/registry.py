"""One generic registry: name → item, with a decorator, duplicate detection, "did you mean" on a miss,
and lazy plug-ins (``"package.module:object"`` strings and an entry-point group).

Estimators, case kinds and targets are all registries. A registry is a read-only ``Mapping``:
``ESTIMATORS["k3"]`` returns the item and a miss raises :class:`UnknownName` (a ``KeyError`` and a
:class:`~kl_bench.foundation.errors.SpecError`) whose message suggests the closest name.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, TypeVar

from .errors import SpecError

T = TypeVar("T")


def did_you_mean(name: str, choices: list[str]) -> str:
    """Return ' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


class UnknownName(SpecError, KeyError):
    """A registry lookup that found nothing; ``str()`` is the one-line message."""

    __str__ = SpecError.__str__


@contextlib.contextmanager
def plugin_path(folder: str | Path | None) -> Iterator[None]:
    """Plug-ins named in a spec are looked for beside the spec too, as a user who writes ``mykl.py`` next
    to ``my.toml`` expects: the spec's folder is on the import path while the spec's names are resolved
    (later lookups find the module in Python's import cache)."""
    entry = str(Path(folder).resolve()) if folder is not None and Path(folder).is_dir() else None
    added = entry is not None and entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)


def import_object(ref: str, what: str) -> Any:
    """Import ``"package.module:attr.path"``; a failure is one line naming ``ref`` (an input error)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise SpecError(f"{what} plug-in '{ref}' must look like 'package.module:object'")
    # The standard library holds no estimator but sys.exit, os._exit, os.system and the like: refuse it
    # by name, before anything is imported or called.
    if module_name.split(".")[0] in sys.stdlib_module_names | {"_sitebuiltins"}:
        raise SpecError(f"{what} plug-in '{ref}' names Python's standard library ('{module_name}'): a plug-in "
                        "is an object of your own module")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # an ImportError, or whatever the module raised (sys.exit included)
        why = f"it called sys.exit({e.code!r})" if isinstance(e, SystemExit) else \
            f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise SpecError(f"{what} plug-in '{ref}' cannot be imported: {why}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"{what} plug-in '{ref}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


class Registry(Mapping[str, T], Generic[T]):
    """Named items of one kind.

    ``adapt`` turns a plug-in object (imported from ``"module:object"`` or from the entry-point group
    ``entry_points``) into an item. Plug-ins are resolved on every lookup (Python caches the import) and
    never stored, so a reloaded module is seen and listings do not depend on what ran before; ``in``,
    ``len`` and iteration see the registered items and those declared lazily (:meth:`add_lazy`: imported
    on first lookup), not plug-ins; ``get`` returns its default on any miss.
    """

    def __init__(self, what: str, *, entry_points: str | None = None,
                 adapt: Callable[[str, Any], T] | None = None):
        self.what = what
        self.entry_points = entry_points
        self._adapt = adapt
        self._items: dict[str, T] = {}
        self._lazy: dict[str, str] = {}       # name → the module that registers it when imported
        self._order: dict[str, None] = {}     # every name, in the order it was first declared or added
        self._strays: dict[str, list[str]] = {}   # lazy name → what its module registered instead of it

    def add_lazy(self, name: str, module: str) -> None:
        """Know ``name`` now and import ``module`` (which registers it) on its first lookup: a built-in
        item that costs nothing until a spec or a listing asks for it."""
        if name not in self._items:
            self._lazy[name] = module
            self._order.setdefault(name)

    def add(self, name: str, item: T, *, replace: bool = False) -> T:
        """Register ``item`` as ``name``; a second registration of one name is an error unless
        ``replace`` (tests swap in broken items that way)."""
        if name in self._items and not replace:
            raise ValueError(f"duplicate {self.what} '{name}'")
        self._items[name] = item
        self._lazy.pop(name, None)
        self._order.setdefault(name)
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""
        return lambda item: self.add(name, item)

    def remove(self, name: str) -> None:
        """Unregister ``name`` (tests register temporary items)."""
        self._items.pop(name, None)
        self._lazy.pop(name, None)
        self._order.pop(name, None)
        self._strays.pop(name, None)

    def __getitem__(self, name: str) -> T:
        if name in self._items:
            return self._items[name]
        if isinstance(name, str) and name in self._lazy:
            return self._load(name)
        if self._adapt is not None and isinstance(name, str):
            if ":" in name:
                return self._adapt(name, import_object(name, self.what))
            found = self._from_entry_points(name)
            if found is not None:
                return found
        known = ", ".join(self.names())
        raise UnknownName(f"unknown {self.what} '{name}'{did_you_mean(str(name), self.names())}; "
                          f"known: {known}")

    def _load(self, name: str) -> T:
        """Import the module declared for the lazy ``name``; it registers the name, or the lookup is one line
        naming the module and what it registered instead (a kind module ``coin`` that registers ``toy_coin``)."""
        module = self._lazy[name]
        before = set(self._items)
        try:
            importlib.import_module(module)     # the module registers the name (add drops it from _lazy)
        except (Exception, SystemExit) as e:    # kept lazy: a later lookup tries again and says why again
            raise SpecError(f"{self.what} '{name}' cannot be loaded (module {module}): "
                            f"{e.__class__.__name__}: {e}") from None
        if name in self._items:
            return self._items[name]
        # Imported, but the name is not among what it registered: remembered from the first import (a later
        # lookup finds the module in Python's import cache and sees nothing new).
        strays = self._strays.setdefault(name, [n for n in self._items if n not in before])
        instead = (f"registers {', '.join(repr(n) for n in strays)} instead" if strays
                   else f"registers no {self.what} of that name")
        raise SpecError(f"{self.what} '{name}': module {module} {instead}; register it as '{name}', "
                        "the name of its module")

    def _from_entry_points(self, name: str) -> T | None:
        if self.entry_points is None:
            return None
        from importlib.metadata import entry_points
        for ep in entry_points(group=self.entry_points):
            if ep.name == name:
                try:
                    obj = ep.load()
                except (Exception, SystemExit) as e:
                    raise SpecError(f"{self.what} '{name}' (entry point {ep.value}) cannot be loaded: "
                                    f"{e.__class__.__name__}: {e}") from None
                return self._adapt(name, obj)
        return None

    def get(self, name: str, default: Any = None) -> T | Any:
        """``self[name]``, or ``default`` when it is unknown or a plug-in cannot be loaded."""
        try:
            return self[name]
        except SpecError:
            return default

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> list[str]:
        """Every name, registered or declared lazily, in the order first declared (not import order)."""
        return [n for n in self._order if n in self._items or n in self._lazy]
