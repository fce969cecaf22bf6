"""The orchestrator needs no MLX: every module but the in-process one (orchestrator/local.py) imports without
loading it, and none reaches into a network's private names."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import orchestrator

ROOT = Path(__file__).resolve().parents[2]
IN_PROCESS = "orchestrator.local"  # the engines in this process: MLX by design
MODULES = sorted(m.name for m in pkgutil.walk_packages(orchestrator.__path__, "orchestrator."))

# imports the named modules in a fresh interpreter and prints which MLX modules that loaded
_PROBE = ("import importlib, json, sys\n"
          "for name in sys.argv[1:]: importlib.import_module(name)\n"
          "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx')))")


def _mlx_loaded_by(*modules: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _PROBE, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_every_module_is_found():
    assert {"orchestrator.cli", "orchestrator.conversation", "orchestrator.realtime", "orchestrator.session",
            "orchestrator.stream_clients", IN_PROCESS} <= set(MODULES)


def test_the_orchestrator_imports_no_mlx():
    assert _mlx_loaded_by(*(m for m in MODULES if m != IN_PROCESS)) == []


def test_the_in_process_module_is_what_loads_mlx():
    # the probe sees MLX when it is there: the same check on the in-process module finds it
    assert "mlx.core" in _mlx_loaded_by(IN_PROCESS)


def _private_imports(path: Path) -> list[str]:
    """`module.name` for every `from services... import _name` (or a private module on the way) in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "services":
            private_module = any(part.startswith("_") for part in node.module.split("."))
            found += [f"{node.module}.{a.name}" for a in node.names if private_module or a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "services"
                      and any(part.startswith("_") for part in a.name.split("."))]
    return found


def test_no_orchestrator_module_imports_a_private_name_of_the_services():
    offenders = {str(p.relative_to(ROOT)): _private_imports(p) for p in sorted((ROOT / "orchestrator").rglob("*.py"))}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_a_private_import_is_caught(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from services.perception.engine import _vocabulary\n"
                     "import services.common._hidden\nfrom services.common.config import VoiceChatConfig\n")
    assert sorted(_private_imports(probe)) == ["services.common._hidden", "services.perception.engine._vocabulary"]
