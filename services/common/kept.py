"""Values an engine computes once and keeps for its next callers: the most recently used few, by key."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

Value = TypeVar("Value")


def kept(values: dict[Hashable, Value], key: Hashable, make: Callable[[], Value], limit: int) -> Value:
    """`values[key]`, made by `make()` when it is not there; `values` keeps the `limit` most recently used (a
    dict's order: the least recently used first, dropped first).

    >>> values = {}
    >>> [kept(values, k, lambda: k * 10, limit=2) for k in (1, 2, 1, 3)], list(values)
    ([10, 20, 10, 30], [1, 3])
    """
    value = values.pop(key) if key in values else make()
    values[key] = value  # most recently used last
    while len(values) > limit:
        values.pop(next(iter(values)))
    return value
