"""A service's engine steps, one JSON line each, for lining them up with other processes' timelines.

    log = StepLog.open("/tmp/tts-steps.jsonl")       # a service's --step-log PATH
    log.step(formed, start, end, size)              # from the engine thread, after each batched call

Each line is `{"formed": s, "start": s, "end": s, "size": n}`: when the batch was formed (its steps taken from
the queue), when the engine thread began and ended the call, and how many sessions' steps it held. Times are
`time.monotonic()` seconds: on Linux one clock for every process of a host, so the lines of four services and a
client's arrival times (`bench.load --timeline`) share one axis (`python -m bench.timeline` reads them together).
Each line is appended as its step ends, so a log survives a killed process up to its last step, and several runs
may share one file: readers pick the steps inside a run's window.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class StepLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._failed = False  # a write failed: the log stops, the steps go on

    @classmethod
    def open(cls, path: str | Path) -> StepLog:
        """A log appending to `path`, created now if missing: an OSError names it at once, not at the first step."""
        with open(path, "a", encoding="utf-8"):
            pass
        return cls(path)

    def step(self, formed: float, start: float, end: float, size: int) -> None:
        """Append one step's line (opened and closed per line: nothing to close, and several writers may share
        a file, each line appended whole)."""
        line = json.dumps({"formed": round(formed, 6), "start": round(start, 6), "end": round(end, 6), "size": size})
        with self._lock:
            if self._failed:
                return
            try:
                with self.path.open("a", encoding="utf-8") as stream:
                    stream.write(line + "\n")
            except OSError as exc:  # a full disk must not fail the sessions' steps
                self._failed = True
                log.warning("step log %s: %s; no more steps are logged", self.path, exc)


def read_steps(path: str | Path) -> list[dict]:
    """Every step of a log, in order; a last line cut short by a killed writer is left out."""
    steps = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return steps
