"""The launcher's defaults for the services it starts."""

from pathlib import Path

from orchestrator.launcher import SHARED_CACHE_LIMIT, launched
from services.common import cli


def _parsed(pid: int, model: Path):
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    flags = [a.decode() for a in argv[argv.index(b"services.codec") + 1 :]]
    return cli.parse_args(cli.build_parser("codec", "test"), flags)


def test_launched_services_bound_their_buffer_cache_unless_told_otherwise(tiny_checkpoint):
    with launched(tiny_checkpoint, names=("codec",)) as children:
        limit = _parsed(children["codec"][0].process.pid, tiny_checkpoint).cache_limit_mb
        assert limit == SHARED_CACHE_LIMIT == cli.SHARED
    with launched(tiny_checkpoint, names=("codec",), flags={"codec": ["--cache-limit-mb", "100"]}) as children:
        assert _parsed(children["codec"][0].process.pid, tiny_checkpoint).cache_limit_mb == 100


def _environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if e)


def test_launched_services_get_their_own_environment_variables_over_this_processs(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("VOICECHAT_PROBE", "parent")
    monkeypatch.setenv("VOICECHAT_KEPT", "parent")
    envs = {"codec": {"VOICECHAT_PROBE": "a=b", "VOICECHAT_NEW": ""}, "llm": {"VOICECHAT_PROBE": "llm"}}
    with launched(tiny_checkpoint, names=("codec",), envs=envs) as children:
        env = _environment(children["codec"][0].process.pid)
    assert (env["VOICECHAT_PROBE"], env["VOICECHAT_NEW"], env["VOICECHAT_KEPT"]) == ("a=b", "", "parent")
    with launched(tiny_checkpoint, names=("codec",)) as children:
        assert _environment(children["codec"][0].process.pid)["VOICECHAT_PROBE"] == "parent"


def test_a_shared_devices_cache_is_an_eightieth_of_its_memory_and_its_headroom_a_twentieth_at_most_8_gib():
    gib = 1 << 30
    assert cli.shared_cache_limit_mb({"total_memory": 80 * gib}) == 80 * 1024 / 80  # an 80 GB card: 1 GiB
    assert cli.shared_headroom_mb({"total_memory": 80 * gib}) == 80 * 1024 / 20  # 4 GiB kept free for the others
    assert cli.shared_cache_limit_mb({"memory_size": 64 * gib}) == 64 * 1024 / 80  # Apple silicon reports this key
    assert cli.shared_headroom_mb({"memory_size": 64 * gib}) == 64 * 1024 / 20
    assert cli.shared_cache_limit_mb({"total_memory": 800 * gib}) == 8192  # capped
    assert cli.shared_headroom_mb({"total_memory": 200 * gib}) == 8192
    for unknown in ({}, {"architecture": "x86_64"}, {"total_memory": 0}, {"memory_size": "64 GB"}):
        assert cli.shared_cache_limit_mb(unknown) == cli.shared_headroom_mb(unknown) == 8192


def test_the_shared_limit_is_set_as_mlxs_cache_limit():
    import mlx.core as mx

    previous = mx.set_cache_limit(1 << 40)
    try:
        cli.apply_cache_limit(cli.SHARED)
        assert mx.set_cache_limit(1 << 40) == int(cli.shared_cache_limit_mb() * (1 << 20))
        cli.apply_cache_limit(100)
        assert mx.set_cache_limit(1 << 40) == 100 << 20
    finally:
        mx.set_cache_limit(previous)
