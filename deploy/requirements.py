"""The project's runtime requirements from pyproject.toml, less MLX, for an image that installs its own MLX build:

    python deploy/requirements.py pyproject.toml > requirements.txt
    pip install "mlx[cpu]==0.32.4" -r requirements.txt && pip install --no-deps .

pyproject asks for `mlx[cpu]` on Linux. A CUDA image wants `mlx[cuda12]` instead, and both extras in one
environment would unpack two builds of libmlx over each other, so the image installs MLX on its own.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def canonical(name: str) -> str:
    """A distribution name as pip compares them: `Foo_Bar.baz` -> "foo-bar-baz"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """`"mlx[cpu]==0.32.4; sys_platform == 'linux'"` -> "mlx"."""
    match = _NAME.match(requirement.strip())
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return canonical(match.group())


def requirements(pyproject: Path, without: str = "mlx") -> list[str]:
    """[project].dependencies of `pyproject`, minus every requirement of the distribution `without`."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [r for r in dependencies if requirement_name(r) != canonical(without)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/requirements.py PYPROJECT_TOML", file=sys.stderr)
        return 2
    print("\n".join(requirements(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
