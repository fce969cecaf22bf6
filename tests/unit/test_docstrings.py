"""Every example in a docstring (`>>>`) of services/, orchestrator/ and tools/ runs, and prints what it shows:
the modules that carry examples are found by their text, so a new example is run from the day it is written."""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for package in ("services", "orchestrator", "tools")
    for path in (ROOT / package).rglob("*.py")
    if ">>>" in path.read_text(encoding="utf-8")
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL


def test_the_examples_are_found():
    assert "services.common.cache" in MODULES and "orchestrator.audio" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    results = doctest.testmod(importlib.import_module(name), optionflags=FLAGS, report=True)
    assert results.attempted > 0 and results.failed == 0, f"{name}: {results.failed} of {results.attempted} failed"
