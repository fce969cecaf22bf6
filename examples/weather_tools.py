"""Tools the server runs itself: `orchestrator serve --tools examples/weather_tools.py`.

Every public function here becomes a tool every session declares: the docstring's first paragraph is its
description, the `Args:` lines describe the parameters, the type hints give their JSON schema. When the model
calls one, the server runs it (with --tool-timeout), reads the result back to the model on the function channel
and reports it to the client as conversation.item.created (a FunctionCallOutputAdded over gRPC).
"""

from __future__ import annotations

from typing import Literal

_CITIES = {"paris": (21, "clear"), "oslo": (4, "snow"), "lima": (18, "fog")}


def get_weather(city: str, unit: Literal["C", "F"] = "C") -> dict:
    """The current weather in a city.

    Args:
        city: the city's name, e.g. "Paris"
        unit: the temperature unit
    """
    temp_c, sky = _CITIES.get(city.strip().lower(), (15, "cloudy"))
    temp = temp_c if unit == "C" else round(temp_c * 9 / 5 + 32)
    return {"city": city, "sky": sky, "temperature": temp, "unit": unit}


def add(a: float, b: float) -> float:
    """Add two numbers exactly, so the model need not.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
