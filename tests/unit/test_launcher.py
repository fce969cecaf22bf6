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
        assert _parsed(children["codec"].process.pid, tiny_checkpoint).cache_limit_mb == SHARED_CACHE_LIMIT_MB
    with launched(tiny_checkpoint, names=("codec",), flags={"codec": ["--cache-limit-mb", "100"]}) as children:
        assert _parsed(children["codec"].process.pid, tiny_checkpoint).cache_limit_mb == 100
