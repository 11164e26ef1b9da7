"""How the review pages write values: times, scores, sizes, signed changes, JSON and chat messages."""

from __future__ import annotations

import contextlib
import json
import re
from datetime import UTC, datetime
from typing import Any

import orjson

from sparring.wire import json_bytes

# A run of digits that may be an integer past 64 bits, which orjson reads as a rounded float.
_LONG_DIGITS = re.compile(r"\d{19}")


def pretty(text: str | None) -> str:
    if not text:
        return ""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    if _LONG_DIGITS.search(text):
        with contextlib.suppress(ValueError):  # Python's json keeps every digit (up to its 4,300)
            return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


def when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else ""


def score(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def ms(value: float | None) -> str:
    return "" if value is None else (f"{value:.0f}" if value >= 100 else f"{value:.3g}")


def pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def thousands(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def duration(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    seconds = (end - start).total_seconds()
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def signed(value: float | None, digits: str = ".3g", unit: str = "") -> str:
    """A change with its sign always shown (−, not -); '0' when nothing changed; '' when unknown."""
    if value is None:
        return ""
    if abs(value) < 1e-12:
        return f"0{unit}"
    text = format(abs(value), digits)
    return f"{'+' if value > 0 else '−'}{text}{unit}"


def signed_pct(value: float | None) -> str:
    return "" if value is None else signed(100 * value, ".1f", " pp")


def is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def json_text(value: Any) -> str:
    return json_bytes(value, default=str, indent=True).decode()


def content(message: dict[str, Any]) -> str:
    """A chat message's text (content parts joined); tool calls it made as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    else:
        text = "" if content is None else str(content)
    if message.get("tool_calls"):
        text += ("\n" if text else "") + json_text(message["tool_calls"])
    return text


def tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and function.get("name"):
            return str(function["name"])
        if tool.get("name"):
            return str(tool["name"])
    return "?"


def size(text: str | None) -> str:
    n = len((text or "").encode())
    if n < 1000:
        return f"{n} B"
    return f"{n / 1000:.1f} kB" if n < 1_000_000 else f"{n / 1_000_000:.2f} MB"
