"""Server-side tools: a Python module's functions become declared tools, and their calls run here.

    # weather_tools.py
    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> dict:
        '''The current weather in a city.

        Args:
            city: the city's name, e.g. "Paris"
            unit: the temperature unit
        '''

    runner = ToolRunner.from_module("weather_tools", timeout_s=10)   # `orchestrator serve --tools weather_tools`
    runner.tools        # [Tool("get_weather", "The current weather in a city.", {JSON schema from the hints})]
    runner.start(call_id, "get_weather", '{"city": "Paris"}', done)   # done(call_id, output) on a worker thread

Every public function defined in the module (or named in its `__all__`) is a tool: its docstring's first paragraph
is the description, an `Args:` section gives the parameters' descriptions, the type hints give the schema
(parameters without a default are required). A call runs on a worker thread with a timeout; what it returns goes
back as its output (a string as is, anything else as JSON), and an exception or a timeout goes back as
`{"error": "..."}` so the model hears about it. A call that timed out keeps its thread until it returns (Python
cannot stop a thread): give slow tools their own timeouts.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from orchestrator.tools import MAX_TOOLS, Tool, check_distinct

DEFAULT_TIMEOUT_S = 10.0
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def json_schema(hint: Any, where: str) -> dict:
    """A type hint as JSON schema: str/int/float/bool, list[X], dict[str, X], Literal[...], X | None.

    >>> json_schema(list[int], "x")
    {'type': 'array', 'items': {'type': 'integer'}}
    """
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1:
            return json_schema(kept[0], where)
        return {"anyOf": [json_schema(a, where) for a in kept]}
    if hint is list or origin is list:
        return {"type": "array", **({"items": json_schema(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object", **({"additionalProperties": json_schema(args[1], where)} if args else {})}
    raise ValueError(f"{where}: type {hint!r} has no JSON schema here; use str, int, float, bool, list[...], "
                     "dict[str, ...], Literal[...] or X | None")


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """(first paragraph, {parameter: description} from a Google-style `Args:` section)."""
    doc = inspect.getdoc(fn) or ""
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    args: dict[str, str] = {}
    section = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        for line in section.group(1).splitlines():
            match = re.match(r"\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if match:
                args[match.group(1)] = match.group(2).strip()
    return summary, args


def function_tool(fn: Callable) -> Tool:
    """The tool a typed, documented function declares; ValueError naming what is missing."""
    name = fn.__name__
    summary, described = _docstring(fn)
    if not summary:
        raise ValueError(f"tool function {name} has no docstring: its first paragraph is the tool's description")
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool function {name}: *{param.name} has no schema; name every parameter")
        if param.name not in hints:
            raise ValueError(f"tool function {name}: parameter {param.name} needs a type hint")
        schema = json_schema(hints[param.name], f"tool function {name}, parameter {param.name}")
        if param.name in described:
            schema["description"] = described[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    return Tool(name, summary, {"type": "object", "properties": properties, "required": required})


def module_functions(module: types.ModuleType) -> list[Callable]:
    """The module's `__all__`, or else its public functions defined in it (not imported), in source order."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_") and inspect.isfunction(v)
                 and v.__module__ == module.__name__]
    return [getattr(module, n) for n in names]


class ToolRunner:
    """Runs the calls of its tools on worker threads, each with `timeout_s`."""

    def __init__(self, functions: list[Callable], timeout_s: float = DEFAULT_TIMEOUT_S, max_workers: int = 4):
        if not timeout_s > 0:
            raise ValueError(f"the tool timeout must be positive, got {timeout_s}")
        if not functions:
            raise ValueError("no tool functions: the module defines no public function")
        if len(functions) > MAX_TOOLS:
            raise ValueError(f"{len(functions)} tool functions; a session declares at most {MAX_TOOLS} tools")
        self.tools = [function_tool(fn) for fn in functions]
        check_distinct(self.tools)
        self.functions = {fn.__name__: fn for fn in functions}
        self.timeout_s = timeout_s
        # calls run here; a watcher per call waits for its result or its timeout
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="tool-call")
        self._watchers = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="tool-watch")

    @classmethod
    def from_module(cls, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ToolRunner:
        """The tools of an importable module (`package.module`) or of a file (`path/to/tools.py`); ValueError when
        it cannot be imported."""
        try:
            module = _load_file(Path(name)) if name.endswith(".py") else importlib.import_module(name)
        except (ImportError, OSError) as exc:
            raise ValueError(f"cannot import it ({exc}); give an importable module name (on PYTHONPATH or in "
                             "the working directory)") from None
        return cls(module_functions(module), timeout_s)

    @property
    def names(self) -> set[str]:
        return set(self.functions)

    def call(self, name: str, arguments: str) -> str:
        """Run one call and wait (at most the timeout): its output text, or `{"error": ...}`."""
        try:
            kwargs = json.loads(arguments)
            if not isinstance(kwargs, dict):
                raise ValueError("arguments must be a JSON object")
            future = self._calls.submit(self.functions[name], **kwargs)
        except (ValueError, KeyError) as exc:
            return _error_output(f"{name}: {exc}")
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            return _error_output(f"{name} did not finish within {self.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - the tool's own failure is its output
            return _error_output(f"{name} failed: {type(exc).__name__}: {exc}")
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)

    def start(self, call_id: str, name: str, arguments: str, done: Callable[[str, str], None]) -> None:
        """Run the call off the caller's thread; `done(call_id, output)` when it finishes or times out."""
        self._watchers.submit(lambda: done(call_id, self.call(name, arguments)))

    def close(self) -> None:
        self._watchers.shutdown(wait=False, cancel_futures=True)
        self._calls.shutdown(wait=False, cancel_futures=True)


def _load_file(path: Path) -> types.ModuleType:
    """A .py file as a module named after its stem."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or not path.is_file():
        raise ImportError(f"no such file: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error_output(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)
