"""The current docs name files that exist: every repository path they quote (`bench/...`, `services/...`, ...)
is there, and the performance pages link each other."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CURRENT = ["README.md", "docs/ARCHITECTURE.md", "docs/performance.md", "docs/protocol.md"]
QUOTED = re.compile(r"`((?:bench|docs|orchestrator|protos|services|tests|tools)/[\w./-]*\w)")


@pytest.mark.parametrize("doc", CURRENT)
def test_every_quoted_repository_path_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted({path for path in QUOTED.findall(text) if not (ROOT / path).exists()})
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_the_performance_pages_link_each_other():
    current = (ROOT / "docs/performance.md").read_text(encoding="utf-8")
    history = (ROOT / "docs/performance-history.md").read_text(encoding="utf-8")
    assert "(performance-history.md)" in current and "(performance.md)" in history
