"""A generic name → item registry with a decorator, duplicate detection and "did you mean"."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

from .errors import SpecError

T = TypeVar("T")


def did_you_mean(name: str, choices: list[str]) -> str:
    """Return ' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Registry(Generic[T]):
    """Named items of one kind (estimators, case kinds). Lookups fail with a suggestion."""

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"duplicate {self.what} '{name}'")
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""
        return lambda item: self.add(name, item)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(self._items)
            raise SpecError(f"unknown {self.what} '{name}'{did_you_mean(name, list(self._items))}; "
                            f"known: {known}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def items(self):
        return self._items.items()

    def names(self) -> list[str]:
        return list(self._items)
