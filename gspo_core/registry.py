"""Name -> function registries for losses and advantage estimators (the trainer picks by name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A small named registry: ``@REG.register("name")`` then ``REG.get("name")``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)


LOSSES: Registry = Registry("loss")
#: The training primitives' losses over `gspo_core.primitives.Datum` rows (`gspo_core.datum_losses`).
DATUM_LOSSES: Registry = Registry("loss")
ADVANTAGES: Registry = Registry("advantage estimator")
