"""A name -> function registry, so a config string picks an estimator or loss (idea from verl)."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    def __init__(self, kind: str, config_field: str) -> None:
        self.kind = kind
        self.config_field = config_field
        self._items: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return add

    def get(self, name: str) -> Callable:
        if name not in self._items:
            raise KeyError(
                f"{self.config_field}={name!r}: unknown {self.kind}; choose one of {', '.join(sorted(self._items))}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)
