"""bench.failover's replicas: a revived replica whose old port is held for a moment is started again."""

from types import SimpleNamespace

import pytest

from bench.failover import Replicas
from orchestrator.launcher import LaunchError


class Exited:
    returncode = -9

    def poll(self):
        return self.returncode


class Running:
    def poll(self):
        return None


def replicas_with(outcomes: list[str | None]):
    """A Replicas whose one replica is gone and whose starts end as `outcomes` say (an error's text, or None: it
    runs); the names each start was asked for."""
    replicas = object.__new__(Replicas)
    replicas.children = {"codec-0": SimpleNamespace(process=Exited()), "codec-1": SimpleNamespace(process=Running())}
    asked = []

    def start(names):
        asked.append(list(names))
        error = outcomes.pop(0)
        replicas.children["codec-0"] = SimpleNamespace(process=Exited() if error else Running())
        if error:
            raise LaunchError(error)

    replicas.start = start
    return replicas, asked


def test_a_port_held_for_a_moment_is_tried_again(monkeypatch):
    monkeypatch.setattr("bench.failover.time.sleep", lambda s: None)
    busy = "the codec service exited with code 1: error: cannot listen on 127.0.0.1:5: the port is in use"
    replicas, asked = replicas_with([busy, busy, None])
    replicas.revive()
    assert asked == [["codec-0"]] * 3 and replicas.children["codec-0"].process.poll() is None


def test_other_failures_and_a_port_held_for_good_end_the_revival(monkeypatch):
    monkeypatch.setattr("bench.failover.time.sleep", lambda s: None)
    replicas, asked = replicas_with(["the codec service exited with code 1: Traceback ..."])
    with pytest.raises(LaunchError, match="Traceback"):
        replicas.revive()
    assert asked == [["codec-0"]]
    busy = "cannot listen on 127.0.0.1:5: the port is in use"
    replicas, asked = replicas_with([busy] * 3)
    with pytest.raises(LaunchError, match="port is in use"):
        replicas.revive(attempts=3)
    assert len(asked) == 3
