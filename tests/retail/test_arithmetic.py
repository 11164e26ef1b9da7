"""The calculator behind `calculate`: the reference's results and rounding, without `eval`."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tools.retail.arithmetic import CalculationError, calculate


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 2", "4.0"),
        ("3131.1 + 4777.75 + 367.38", "8276.23"),  # task 16's expected answer
        ("155.33 - 147.05 + 268.77 - 235.13", "41.92"),
        ("(1 + 2) * 3", "9.0"),
        ("  1 + 1", "2.0"),  # eval ignores leading blanks
        ("-5 / 2", "-2.5"),
        ("10 / 3", "3.33"),
        ("2.675 * 1", "2.67"),  # binary floats round as Python rounds them
        ("0.1 + 0.2", "0.3"),
        ("-(3 - 5)", "2.0"),
        ("+.5", "0.5"),
        ("164.28", "164.28"),
    ],
)
def test_values(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("abs(-1)", "Invalid characters in expression"),
        ("__import__('os')", "Invalid characters in expression"),
        ("1e5", "Invalid characters in expression"),
        ("2 ** 3", "only +, -, *, / and parentheses are supported"),
        ("7 // 2", "only +, -, *, / and parentheses are supported"),
        ("9 ** 9 ** 9", "only +, -, *, / and parentheses are supported"),
        ("1 / 0", "division by zero"),
        ("1.5 / (2 - 2)", "float division by zero"),
        ("()", "the expression must be a calculation on numbers"),
        ("1 +", "invalid syntax"),
        ("", "invalid syntax"),
        ("(" * 300 + "1" + ")" * 300, "too many nested parentheses"),
    ],
)
def test_refusals(expression: str, message: str) -> None:
    with pytest.raises(CalculationError, match=re.escape(message)):
        calculate(expression)


def test_long_sums_work_as_far_as_eval_goes_then_are_refused() -> None:
    assert calculate("1+" * 999 + "1") == "1000.0"
    # eval fails here too ("maximum recursion depth exceeded during compilation").
    with pytest.raises(CalculationError, match="too deeply nested"):
        calculate("1+" * 4000 + "1")


def test_an_expression_past_the_length_limit_is_refused_before_it_is_parsed() -> None:
    # Parsing one of 640 KB (under the body limit) took seconds of the event loop's time.
    group = "(" + "+".join(["1.5"] * 200) + ")"
    assert calculate("*".join([group] * 12)) == "5.31441e+29"  # 9,623 characters: computed
    with pytest.raises(
        CalculationError, match=r"too long to calculate \(641,599 characters; at most 10,000\)"
    ):
        calculate("+".join([group] * 800))


numbers = st.one_of(
    st.integers(min_value=0, max_value=10**6).map(str),
    st.decimals(min_value=0, max_value=10**5, places=2, allow_nan=False, allow_infinity=False).map(str),
)


def expressions() -> st.SearchStrategy[str]:
    return st.recursive(
        numbers,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(["+", "-", "*", "/"]), inner).map(
                lambda t: f"{t[0]} {t[1]} {t[2]}"
            ),
            inner.map(lambda e: f"({e})"),
            inner.map(lambda e: f"-{e}"),
        ),
        max_leaves=8,
    )


@settings(max_examples=300, deadline=None)
@given(expressions())
def test_agrees_with_the_reference_eval(expression: str) -> None:
    # The reference computes str(round(float(eval(...)), 2)); here, and only here, eval is the oracle.
    try:
        expected = str(round(float(eval(expression, {"__builtins__": None}, {})), 2))
    except (ZeroDivisionError, OverflowError) as exc:
        with pytest.raises(CalculationError, match=re.escape(str(exc))):
            calculate(expression)
        return
    assert calculate(expression) == expected
