"""A request sent to a service whose answer is taken later.

A stage of the online session sends a frame's request as soon as the frame reaches it and takes the answer
when it needs it, so the service has the next request in hand when it finishes the last one:

    pending = speech.send_step(text_id)    # sent now
    codes = pending.result()               # waits for this answer (answers come in the order sent)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Pending(Generic[T]):
    """A request sent whose answer has not been taken yet: `result()` waits for it. Answers are taken in the
    order their requests were sent."""

    __slots__ = ("_wait",)

    def __init__(self, wait: Callable[[], T]):
        self._wait = wait

    def result(self) -> T:
        return self._wait()

    @classmethod
    def answered(cls, value: T) -> Pending[T]:
        """A request answered without a call (the stage had nothing to ask)."""
        return cls(lambda: value)

    def then(self, decode: Callable[[T], U]) -> Pending[U]:
        return Pending(lambda: decode(self._wait()))
