"""The launcher's defaults for the services it starts."""

from pathlib import Path

from orchestrator.launcher import SHARED_CACHE_LIMIT_MB, launched
from services.common import cli


def _parsed(pid: int, model: Path):
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    flags = [a.decode() for a in argv[argv.index(b"services.codec") + 1 :]]
    return cli.parse_args(cli.build_parser("codec", "test"), flags)


def test_launched_services_bound_their_buffer_cache_unless_told_otherwise(tiny_checkpoint):
    with launched(tiny_checkpoint, names=("codec",)) as children:
        assert _parsed(children["codec"][0].process.pid, tiny_checkpoint).cache_limit_mb == SHARED_CACHE_LIMIT_MB
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
