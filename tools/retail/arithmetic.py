"""A calculator for the `calculate` tool: + - * / and parentheses over numbers, without `eval`."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

ALLOWED_CHARACTERS = frozenset("0123456789+-*/(). ")
# The reference's `eval` takes any length; parsing one of 800 KB (the body limit) takes seconds. No
# task's expression comes near this (the longest gold one is 41 characters).
MAX_EXPRESSION_CHARS = 10_000

Number = int | float

# Python's own operators on Python numbers: integer literals stay exact until the final conversion
# to float, exactly as the reference's `eval` computes them, so results and rounding agree.
_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """The expression cannot be computed; the message says why, in the reference's words where it has them."""


def calculate(expression: str) -> str:
    """The value of `expression` rounded to 2 decimals, as text (e.g. '8276.23', '10.0')."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(
            f"expression is too long to calculate ({len(expression):,} characters; at most "
            f"{MAX_EXPRESSION_CHARS:,})"
        )
    if not all(char in ALLOWED_CHARACTERS for char in expression):
        raise CalculationError("Invalid characters in expression")
    try:
        # `eval` of a string ignores leading blanks; the parser does not.
        tree = ast.parse(expression.lstrip(" "), filename="<string>", mode="eval")
        value = _evaluate(tree.body)
        return str(round(float(value), 2))
    except SyntaxError as exc:
        raise CalculationError(str(exc)) from exc
    except (ZeroDivisionError, OverflowError, ValueError) as exc:
        raise CalculationError(str(exc)) from exc
    except RecursionError as exc:
        raise CalculationError("expression is too deeply nested to calculate") from exc


def _evaluate(root: ast.expr) -> Number:
    # Iterative, left operand first: a long flat sum is a deep tree, deeper than Python's recursion limit.
    pending: list[tuple[ast.expr, bool]] = [(root, False)]
    values: list[Number] = []
    while pending:
        node, operands_done = pending.pop()
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            values.append(node.value)  # bool and complex literals cannot pass the character check
        elif isinstance(node, ast.BinOp):
            binary = _BINARY.get(type(node.op))
            if binary is None:
                # `**` and `//` pass the character check; a power can take unbounded time: neither is offered.
                raise CalculationError("only +, -, *, / and parentheses are supported")
            if operands_done:
                right, left = values.pop(), values.pop()
                values.append(binary(left, right))
            else:
                pending += [(node, True), (node.right, False), (node.left, False)]
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            if operands_done:
                values.append(_UNARY[type(node.op)](values.pop()))
            else:
                pending += [(node, True), (node.operand, False)]
        else:
            raise CalculationError("the expression must be a calculation on numbers, such as '2 + 2'")
    return values.pop()
