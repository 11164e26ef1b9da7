"""app/grounding.py: the one answer-grounding implementation behind the grader and the review flag."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app import grounding
from app.grading import flags as review_flags
from app.grading.graders import model as grading_model
from app.grounding import (
    answer_hash,
    canonical_number,
    claims,
    final_answer,
    haystack,
    normalize_answer,
    normalize_text,
    numbers_in,
    prompt_texts,
    ungrounded,
)
from tests.conftest import GRADER_KEY, AppFactory, new_trace
from tests.grading.test_routes import GRADERS, ledger_pack, sample, write_graders

ORDER = (
    '{"order_id": "W2378156", "total": 1234.5, "items": [{"name": "Urban Puffer Jacket", "price": 189.99}]}'
)


def test_one_implementation_is_shared() -> None:
    assert grading_model.final_answer is grounding.final_answer
    assert review_flags.final_answer is grounding.final_answer
    assert review_flags.answer_hash is grounding.answer_hash
    assert review_flags.normalize_answer is grounding.normalize_answer


# --- numbers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234.50", {"1234.5"}),  # thousands separator and trailing zero
        ("12,345,678", {"12345678"}),
        ("1,23", {"1", "23"}),  # a comma not followed by 3 digits is a list separator
        ("-0.50 and 0.75", {"-0.5", "0.75"}),
        ("1000.00", {"1000"}),
        ("1e3 and 2.50e-2", {"1000", "0.025"}),
        ("$5, 5% and (42)", {"5", "42"}),
        ("It ended at 3.", {"3"}),  # sentence full stop is not a decimal point
        ("3.14.", {"3.14"}),
        ("W2378156", set()),  # an identifier's digits are not a number
        ("#W2378156 v2 a1 2b", set()),
        ("1.5.6", set()),  # a version string is not a number
        (".5", set()),
        ("no numbers here", set()),
    ],
)
def test_numbers_in(text: str, expected: set[str]) -> None:
    assert numbers_in(text) == expected


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("1,234.50", "1234.5"),
        ("100", "100"),
        ("1e3", "1000"),
        ("-0.500", "-0.5"),
        ("1.0", "1"),
        ("x", None),
        ("1e60", "1" + "0" * 60),
        # Past 60 digits or a power of ten of 60, no checkable fact (written out, 1e999999999 would overflow
        # the decimal context, and 5,000 digits pass Python's limit on int()).
        ("1e61", None),
        ("7" * 5000, None),
        ("1e999999999", None),
        ("1e-999999999", None),
    ],
)
def test_canonical_number(token: str, expected: str | None) -> None:
    assert canonical_number(token) == expected


@pytest.mark.parametrize(
    "answer", ["The total is 1e5000.", "The total is " + "7" * 5000, "Total: 1e999999999"]
)
async def test_a_huge_number_in_the_answer_is_graded_not_a_5xx(
    app_factory: AppFactory, tmp_path: Path, answer: str
) -> None:
    """Every grade with a trace_id computes the review flags, which read the answer's numbers."""
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=graders) as client:
        body = {"sample": sample(answer), "item": {"reference_answer": "42"}, "trace_id": new_trace()}
        response = await client.post("/grade/exact", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {"score": 0.0}


# --- claims ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "below", "numbers", "quoted"),
    [
        ("nothing checkable", 10, [], []),
        ("You have 3 orders and 2 returns.", 10, [], []),  # small whole counts are skipped
        ("You have 3 orders.", 0, ["3"], []),
        ("Costs 2.5 and -4", 10, ["2.5"], []),  # small decimals are facts, small whole numbers are not
        ("1,234.50 then 1234.5 again", 10, ["1234.5"], []),  # deduplicated by value
        ('Paid "$12.50" on 2024-05-01', 10, ["2024"], ["$12.50"]),  # a quote's number goes with the quote
        ("Order W2378156 is cancelled.", 10, [], []),
        ("it's fine, don't worry", 10, [], []),  # apostrophes are not quotes
        ("He said 'ok go', `ls -la` and “fancy one”", 10, [], ["ok go", "ls -la", "fancy one"]),
        ('Grade "A" only', 10, [], []),  # a one-character quote is not a claim
        ('She said "no" and "AB"', 10, [], ["no", "AB"]),
        ('"Blue Widget" and "Blue Widget"', 10, [], ["Blue Widget"]),
    ],
)
def test_claims(answer: str, below: float, numbers: list[str], quoted: list[str]) -> None:
    assert claims(answer, below) == (numbers, quoted)


# --- ungrounded ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "sources", "total", "missing"),
    [
        ("I have cancelled the order.", [ORDER], 0, []),
        ("The total is $1,234.50.", [ORDER], 1, []),
        ("It was 1000.00 dollars.", ["amount: 1,000"], 1, []),  # separators on either side
        ("It was 1e3 dollars.", ['{"amount": 1000}'], 1, []),
        ("The jacket costs 189.99 and shipping 12.75.", [ORDER], 2, ["12.75"]),
        ("The total is 1234.5", [], 1, ["1234.5"]),  # no source: nothing grounds it
        ("The total is 1234.5", ["nothing", ORDER], 1, []),  # any source will do
        ("Order 2378156 is cancelled.", [ORDER], 1, ["2378156"]),  # an id's digits ground no number
        ('Order "W2378156" is cancelled.', [ORDER], 1, []),  # but the quoted id is found as text
        ('You bought the "urban  PUFFER jacket".', [ORDER], 1, []),  # case and spacing do not matter
        ('Your "Alpine Parka" is on its way.', [ORDER], 1, ["Alpine Parka"]),
        ('Ship to "Zürich"', ['{"city": "Z\\u00fcrich"}'], 1, []),  # JSON \u escapes are undone
        ('The name is "Café Olé".', ['{"name": "Caf\\u00e9 Ol\\u00e9"}'], 1, []),
        ('The title is “The "Best" Shop”', ['{"title": "The \\"Best\\" Shop"}'], 1, []),  # \" escapes
        ('The title is “The "Worst" Shop”', ['{"title": "The \\"Best\\" Shop"}'], 1, ['The "Worst" Shop']),
        ('It says "line one line two"', ['{"note": "line one\\nline two"}'], 1, []),  # \n escape
        ('Ship to "Zürich"', ["city: Zurich"], 1, ["Zürich"]),  # accents are not dropped
        ("Paid 54.20 for order 9917.", ['{"paid": "54.2", "order": 9917}'], 2, []),
        ("Paid 54.21.", ['{"paid": 54.2}'], 1, ["54.21"]),
    ],
)
def test_ungrounded(answer: str, sources: list[str], total: int, missing: list[str]) -> None:
    assert ungrounded(answer, sources, 10) == (total, missing)
    policy = review_flags.FlagPolicy(ignore_numbers_below=10)
    assert review_flags.ungrounded_values(answer, sources, policy) == missing


@pytest.mark.parametrize(
    ("item", "missing"),
    [
        ({"messages": [{"role": "user", "content": 'Cancel order "W777", I paid 54.20.'}]}, []),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 'Order "W777" for 54.20'}]}]},
            [],
        ),
        (
            {"messages": [{"role": "user", "content": "Cancel W777, I paid 54.20."}]},
            [],
        ),  # quotes need no quotes
        ({"messages": [{"role": "user", "content": "Cancel W778, I paid 54.20."}]}, ["W777"]),
        ({"messages": [{"role": "user", "content": "Cancel my order."}]}, ["54.2", "W777"]),
        ({}, ["54.2", "W777"]),
    ],
)
def test_ungrounded_by_the_prompt(item: dict[str, Any], missing: list[str]) -> None:
    answer = 'Order "W777" (54.20) is cancelled.'
    assert ungrounded(answer, prompt_texts(item), 10) == (2, missing)


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ({}, []),
        ({"messages": "not a list"}, []),
        (
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
            ["Be brief.", "Hi"],
        ),
        ({"messages": [{"content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]}, ["a", ""]),
        ({"messages": [None, {"role": "user"}, {"content": 7}]}, []),
    ],
)
def test_prompt_texts(item: dict[str, Any], expected: list[str]) -> None:
    assert prompt_texts(item) == expected


@pytest.mark.parametrize(
    ("source", "contains", "absent"),
    [
        ("Plain  TEXT\nhere", "plain text here", None),
        ('{"name": "Caf\\u00e9"}', "café", None),
        ('{"a": {"Nested Key": ["x", 1, null]}}', "nested key", "none"),
        ("{not json", "{not json", None),
    ],
)
def test_haystack(source: str, contains: str, absent: str | None) -> None:
    text = haystack(source)
    assert contains in text
    if absent is not None:
        assert absent not in text


# --- the final answer and its hash -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ({}, ""),
        ({"output_text": "hi", "choices": [{"message": {"content": "no"}}]}, "hi"),
        ({"choices": [{"message": {"content": "a"}}, {"message": {"content": "b"}}]}, "b"),
        ({"choices": [{"message": {"content": [{"type": "text", "text": "x"}, {"text": "y"}]}}]}, "xy"),
        ({"choices": [{"message": {"content": [{"type": "image"}, "junk", {"text": 3}]}}]}, "3"),
        ({"choices": [{"message": {"content": None}}]}, ""),
        ({"choices": []}, ""),
        ({"choices": ["junk"]}, ""),
        ({"output_text": 5}, ""),
    ],
)
def test_final_answer(sample: dict[str, Any], expected: str) -> None:
    assert final_answer(sample) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  The  Refund\nis DONE. ", "the refund is done"),
        ("Done!!", "done"),
        ("Ｆｕｌｌ width", "full width"),  # NFKC
        ("Straße", "strasse"),  # casefold
        ("What?", "what?"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_normalize_text_keeps_trailing_punctuation() -> None:
    assert normalize_text(" Done.\t") == "done."


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("The refund is done.", "the refund   is done", True),
        ("Done!", "done", True),
        ("the refund is done", "the refund is not done", False),
    ],
)
def test_answer_hash(a: str, b: str, same: bool) -> None:
    assert (answer_hash(a) == answer_hash(b)) is same
    assert len(answer_hash(a)) == 64


def test_only_the_first_claims_of_each_kind_are_looked_for() -> None:
    """An answer of thousands of quoted strings against a long prompt would hold the event loop for
    seconds: the first CLAIMS_CHECKED of each kind are looked for, and the count says how many it made."""
    quotes = " ".join(f'"quote number {i}"' for i in range(3 * grounding.CLAIMS_CHECKED))
    figures = " ".join(f"{1000 + i}.5" for i in range(3 * grounding.CLAIMS_CHECKED))
    count, missing = grounding.ungrounded(f"{quotes} {figures}", ['"quote number 0" 1000.5'], 10)
    assert count == 6 * grounding.CLAIMS_CHECKED
    assert len(missing) == 2 * (grounding.CLAIMS_CHECKED - 1)
    assert "quote number 0" not in missing and "1000.5" not in missing


def test_a_quote_is_found_within_one_source_only() -> None:
    _, missing = grounding.ungrounded('It said "red apple".', ["a red", "apple pie"], 10)
    assert missing == ["red apple"]
    _, found = grounding.ungrounded('It said "red apple".', ["a red", "the red apple pie"], 10)
    assert found == []
