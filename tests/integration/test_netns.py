"""The four services on four separate hosts: each runs in a network namespace of its own, reached over a veth
pair from this process (the orchestrator's host), and a conversation across them gives the reference's
outputs, as the in-process engines do. The namespaces and links are made here and removed after the test.

Needs root and `ip` (iproute2) on Linux; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from orchestrator.launcher import SERVICES, spawn_service, stop, wait_ready
from orchestrator.session import OnlineSession, transcript_vocabulary
from orchestrator.stream_clients import grpc_stream_clients
from orchestrator.text import TextDecoder
from services.common.config import VoiceChatConfig
from tests.conftest import load_golden


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"vcprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"this machine does not allow network namespaces: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """One namespace per service, each linked to this one by a veth pair on its own /30 of 10.231.0.0/16."""

    def __init__(self, names):
        self.tag = os.getpid() % 10_000
        self.names, self.made, self.links = names, [], []
        base = (os.getpid() % 60) * 4
        self.addresses = {}
        try:
            for k, name in enumerate(names):
                ns, outer, inner = f"vc{self.tag}{name[:4]}", f"vco{self.tag}{k}", f"vci{self.tag}{k}"
                subnet = f"10.231.{base + k}"
                self._run("netns", "add", ns)
                self.made.append(ns)
                self._run("link", "add", outer, "type", "veth", "peer", "name", inner)
                self.links.append(outer)
                self._run("link", "set", inner, "netns", ns)
                self._run("addr", "add", f"{subnet}.1/30", "dev", outer)
                self._run("link", "set", outer, "up")
                self._run("-n", ns, "addr", "add", f"{subnet}.2/30", "dev", inner)
                self._run("-n", ns, "link", "set", inner, "up")
                self._run("-n", ns, "link", "set", "lo", "up")
                self.addresses[name] = (ns, f"{subnet}.2")
        except BaseException:
            self.remove()
            raise

    @staticmethod
    def _run(*args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def remove(self) -> None:
        for link in self.links:
            _ip("link", "del", link)
        for ns in self.made:
            _ip("netns", "del", ns)


@pytest.fixture(scope="module")
def hosts():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    hosts = Hosts(SERVICES)
    yield hosts
    hosts.remove()


def test_a_conversation_across_four_hosts_equals_the_reference(hosts, tiny_checkpoint):
    golden, meta = load_golden("online")
    children = [spawn_service(name, tiny_checkpoint, ["--host", host], wrapper=["ip", "netns", "exec", ns])
                for name, (ns, host) in hosts.addresses.items()]
    try:
        wait_ready(children, timeout_s=60)
        addresses = {child.name: child.address for child in children}
        for name, (_, host) in hosts.addresses.items():
            assert addresses[name].startswith(f"{host}:"), addresses  # each listens on its own host only
        config = VoiceChatConfig.load(tiny_checkpoint)
        clients = grpc_stream_clients(addresses)
        try:
            session = OnlineSession(clients, config, TextDecoder(tiny_checkpoint, config), record=True,
                                    rnnt_vocabulary=transcript_vocabulary(tiny_checkpoint, config))
            waveform, events = golden["waveform"], []
            for start in range(0, len(waveform), 1280):
                events += session.push_audio(waveform[start : start + 1280])
            events += session.flush()
        finally:
            clients.close()
    finally:
        stop(children)
    assert [e.describe() for e in events if e.kind != "audio"] == meta["events"]
    audio = [e for e in events if e.kind == "audio"]
    assert np.array_equal(np.stack([e.audio_codes for e in audio]), golden["audio_codes"])
    assert np.array_equal([r.text_id for r in session.records], golden["text_tokens"])
    assert np.abs(np.concatenate([e.samples for e in audio]) - golden["audio"]).max() <= 1e-4
