"""Answer text and grounding: what the model finally said, and which of its facts a tool gave it.

One implementation serves the `grounded` grader and the review's `ungrounded_answer` flag, so a grade
and a flag about the same answer agree.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson


def last_message(sample: Mapping[str, Any]) -> Mapping[str, Any]:
    """The message of the sample's last choice ({} when it has none)."""
    choices = sample.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[-1], Mapping):
        message = choices[-1].get("message")
        if isinstance(message, Mapping):
            return message
    return {}


def final_answer(sample: Mapping[str, Any]) -> str:
    """The model's final text: `sample.output_text`, else the last choice's message content."""
    text = sample.get("output_text")
    if isinstance(text, str):
        return text
    content = last_message(sample).get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


# A number as written in prose or JSON: 1,234.50  -3  0.75  1e3 (commas only as thousands separators);
# not the digits inside an identifier such as W2378156 or v2.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w|\.\d|,\d{3})")
# Quoted spans: "…", “…”, `…`, and '…' when the quotes are not apostrophes inside words.
_QUOTED = re.compile(
    r"\"([^\"\n]{2,200})\"|“([^”\n]{2,200})”|`([^`\n]{2,200})`|(?<!\w)'([^'\n]{2,200})'(?!\w)"
)
_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


# A number longer than this, or scaled by more than this power of ten, is no checkable fact (and its
# canonical form, 1e999999999 written out, would be as long): it is left out.
NUMBER_DIGITS_MAX = 60


def canonical_number(token: str) -> str | None:
    try:
        value = Decimal(token.replace(",", ""))
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    _, digits, exponent = value.as_tuple()
    if len(digits) > NUMBER_DIGITS_MAX or abs(int(exponent)) > NUMBER_DIGITS_MAX:
        return None
    value = value.normalize()
    return format(value, "f") if value == value.to_integral_value() else str(value)


def numbers_in(text: str) -> set[str]:
    return {n for n in (canonical_number(m.group(0)) for m in _NUMBER.finditer(text)) if n is not None}


def claims(answer: str, ignore_numbers_below: float) -> tuple[list[str], list[str]]:
    """The checkable facts of an answer: its numbers (minus small whole counts) and its quoted strings."""
    quoted = [next(g for g in m.groups() if g is not None).strip() for m in _QUOTED.finditer(answer)]
    quoted = list(dict.fromkeys(q for q in quoted if len(q) >= 2))
    numbers: list[str] = []
    for match in _NUMBER.finditer(_QUOTED.sub(" ", answer)):  # numbers inside quotes go with the quote
        number = canonical_number(match.group(0))
        if number is None or number in numbers:
            continue
        if re.fullmatch(r"-?\d+", number) and abs(int(number)) < ignore_numbers_below:
            continue
        numbers.append(number)
    return numbers, quoted


def _text_leaves(value: Any) -> Iterable[str]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key)
            yield from _text_leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _text_leaves(item)
    elif value is not None:
        yield str(value)


def haystack(text: str) -> str:
    """A source as searchable text: JSON outputs also contribute their decoded strings (escapes undone)."""
    try:
        decoded = orjson.loads(text)
    except orjson.JSONDecodeError:
        return normalize_text(text)
    return normalize_text(text + "\n" + "\n".join(_text_leaves(decoded)))


def prompt_texts(item: Mapping[str, Any]) -> list[str]:
    """The text of the dataset row's messages (what the user and the developer told the model)."""
    messages = item.get("messages")
    if not isinstance(messages, list):
        return []
    texts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return texts


# Of each kind, the claims looked for in the sources: the first ones (an answer of thousands of quoted
# strings against a long prompt would hold the event loop for seconds); the count says how many it made.
CLAIMS_CHECKED = 200


def ungrounded(answer: str, sources: Sequence[str], ignore_numbers_below: float) -> tuple[int, list[str]]:
    """(number of claims, the claims found in no source, of the first CLAIMS_CHECKED of each kind)."""
    made, _, missing = checked_claims(answer, sources, ignore_numbers_below)
    return made, missing


def checked_claims(
    answer: str, sources: Sequence[str], ignore_numbers_below: float
) -> tuple[int, int, list[str]]:
    """(number of claims, how many were looked for: the first CLAIMS_CHECKED of each kind, those of them
    found in no source)."""
    numbers, quoted = claims(answer, ignore_numbers_below)
    if not numbers and not quoted:
        return 0, 0, []
    known: set[str] = set()
    for source in sources:
        known |= numbers_in(source)
    # One text to search: a quote never spans two sources (NUL, which normalized text keeps, between them).
    text = "\0".join(haystack(s) for s in sources)
    missing = [n for n in numbers[:CLAIMS_CHECKED] if n not in known]
    missing += [q for q in quoted[:CLAIMS_CHECKED] if normalize_text(q).replace("\0", " ") not in text]
    checked = min(len(numbers), CLAIMS_CHECKED) + min(len(quoted), CLAIMS_CHECKED)
    return len(numbers) + len(quoted), checked, missing


def normalize_answer(text: str) -> str:
    """Case-, width- and whitespace-insensitive form of an answer (what "the same answer" means)."""
    return normalize_text(text).rstrip(".!").strip()


def answer_hash(text: str) -> str:
    """sha256 (hex) of the normalized answer; stored as Grade.answer_hash."""
    return hashlib.sha256(normalize_answer(text).encode()).hexdigest()
