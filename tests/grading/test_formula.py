"""The multi formula language: semantics, refusals, and property tests against a reference evaluator."""

from __future__ import annotations

import ast
import builtins
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.grading.graders.formula import FUNCTIONS, FormulaRuntimeError, FormulaSyntaxError, compile_formula

NAMES = ("a", "b", "c")
VALUES = {"a": 0.5, "b": 2.0, "c": 0.0}


def evaluate(text: str, values: dict[str, float] | None = None) -> float:
    return compile_formula(text, NAMES).evaluate(VALUES if values is None else values)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the graders guide's shapes
        ("0.9 * a + 0.1 * b", 0.9 * 0.5 + 0.1 * 2.0),
        ("(a + b) / 2", 1.25),
        ("1", 1.0),
        ("a", 0.5),
        ("-a", -0.5),
        ("+a", 0.5),
        ("- -a", 0.5),
        ("a - b - c", 0.5 - 2.0 - 0.0),
        ("b / 4 / 2", 0.25),
        # ^ is a power, right-associative and binding tighter than * (not Python's xor)
        ("2 ^ 3", 8.0),
        ("2 ^ 3 ^ 2", 512.0),
        ("3 * b ^ 2", 12.0),
        ("b ^ -1", 0.5),
        ("-b ^ 2", -4.0),
        ("(-b) ^ 2", 4.0),
        ("b ^ 0.5", math.sqrt(2.0)),
        # functions
        ("min(a, b)", 0.5),
        ("max(a, b, 3)", 3.0),
        ("min(a)", 0.5),
        ("abs(a - b)", 1.5),
        ("floor(2.7)", 2.0),
        ("ceil(2.1)", 3.0),
        ("floor(-0.5)", -1.0),
        ("exp(0)", 1.0),
        ("sqrt(b * 8)", 4.0),
        ("log(exp(2))", 2.0),
        ("log(8, 2)", 3.0),
        ("min(max(a, 0), 1) * (1 - c)", 0.5),
        ("1e-3 * 1000", 1.0),
        ("  a  ", 0.5),
    ],
)
def test_semantics(text: str, expected: float) -> None:
    assert evaluate(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "values", "message"),
    [
        ("a / c", VALUES, "division by zero"),
        ("1 / (a - 0.5)", VALUES, "division by zero"),
        ("sqrt(-b)", VALUES, "math domain error"),
        ("log(c)", VALUES, "math domain error"),
        ("(-b) ^ 0.5", VALUES, "math domain error"),
        ("c ^ -1", VALUES, "math domain error"),
        ("exp(1000)", VALUES, "range"),
        ("10 ^ 400", VALUES, "range"),
        ("1e308 * 10", VALUES, "not a finite number"),
        ("b * 1e308 - b * 1e308 * 2", VALUES, "not a finite number"),
    ],
)
def test_runtime_errors(text: str, values: dict[str, float], message: str) -> None:
    formula = compile_formula(text, NAMES)
    with pytest.raises(FormulaRuntimeError, match=message):
        formula.evaluate(values)


REFUSED = [
    # attribute access, subscripts, calls to other names: the usual escapes
    "a.real",
    "a.__class__",
    "().__class__.__bases__[0].__subclasses__()",
    "a[0]",
    "__import__('os').system('true')",
    "open('/etc/passwd')",
    "eval('1')",
    "exec('x = 1')",
    "getattr(a, 'real')",
    "print(a)",
    "round(a)",
    "pow(a, 2)",
    "a(1)",
    "min.__call__(a)",
    # constructs outside arithmetic
    "lambda: 1",
    "[x for x in a]",
    "(x for x in a)",
    "{x: 1 for x in a}",
    "a if b else c",
    "a and b",
    "not a",
    "a < b",
    "a == b",
    "(a := 1)",
    "f'{a}'",
    "'a'",
    "b'a'",
    "True",
    "None",
    "...",
    "1j",
    "[a]",
    "(a, b)",
    "{a}",
    "{a: b}",
    "*a",
    "await a",
    "yield a",
    # operators that are not in the list
    "a ** 2",
    "a % 2",
    "a // 2",
    "a @ b",
    "a | b",
    "a & b",
    "a << 1",
    "~a",
    # calls with the wrong shape
    "min(a, key=b)",
    "min(*[a])",
    "abs(a, b)",
    "floor()",
    "log(a, b, c)",
    "max()",
    # names
    "d",
    "min",
    "x + 1",
    # not an expression
    "",
    "   ",
    "a = 1",
    "import os",
    "a; b",
    "a +",
    "1 ^^ 2",
    "a\0",
    "1" * 5000,
    "(" * 300 + "a" + ")" * 300,
    "-" * 300 + "a",
    "9" * 400,
]


@pytest.mark.parametrize("text", REFUSED)
def test_refused_at_build_time(text: str) -> None:
    with pytest.raises(FormulaSyntaxError):
        compile_formula(text, NAMES)


def test_refusals_say_what_is_allowed() -> None:
    with pytest.raises(FormulaSyntaxError, match="unknown name 'd': the sub-graders are a, b, c"):
        compile_formula("a + d", NAMES)
    with pytest.raises(FormulaSyntaxError, match="unknown function 'round'"):
        compile_formula("round(a)", NAMES)
    with pytest.raises(FormulaSyntaxError, match="attribute access not allowed"):
        compile_formula("a.real", NAMES)
    with pytest.raises(FormulaSyntaxError, match=r"use \^ for powers"):
        compile_formula("a ** 2", NAMES)


def test_names_used() -> None:
    assert compile_formula("a + min(c, 1)", NAMES).names == frozenset({"a", "c"})


def test_evaluation_runs_no_eval_exec_compile_or_import() -> None:
    formulas = [
        compile_formula(text, NAMES) for text in ("0.9 * a + 0.1 * b", "log(b, 2) ^ 2", "min(a, b, c)")
    ]
    called: list[str] = []

    def forbidden(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            called.append(name)
            raise AssertionError(f"the evaluator called {name}")

        return refuse

    names = ("eval", "exec", "compile", "__import__", "getattr")
    saved = {name: getattr(builtins, name) for name in names}
    try:
        for name in names:
            setattr(builtins, name, forbidden(name))
        results = [f.evaluate(VALUES) for f in formulas]
    finally:
        for name, original in saved.items():
            setattr(builtins, name, original)
    assert called == []
    assert results == [pytest.approx(0.65), pytest.approx(1.0), 0.0]


# --- property tests ----------------------------------------------------------------------------------

ARITY = {name: (fewest, most) for name, (_, fewest, most) in FUNCTIONS.items()}
ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Call, ast.Load)
ALLOWED_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.USub, ast.UAdd)


def within_whitelist(text: str) -> bool:
    """An independent statement of the whitelist, checked on Python's own parse of the text."""
    if "**" in text or not text.strip():
        return False
    try:
        tree = ast.parse(text.replace("^", "**").strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.operator | ast.unaryop):
            if not isinstance(node, ALLOWED_OPS):
                return False
        elif not isinstance(node, ALLOWED_NODES):
            return False
        if isinstance(node, ast.Constant) and not _finite_number(node.value):
            return False
        if isinstance(node, ast.Name) and node.id not in NAMES and not _is_called(tree, node):
            return False
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
                return False
            fewest, most = ARITY[node.func.id]
            if len(node.args) < fewest or (most is not None and len(node.args) > most):
                return False
    return True


def _finite_number(value: object) -> bool:
    if type(value) not in (int, float) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _is_called(tree: ast.AST, name: ast.Name) -> bool:
    return any(isinstance(n, ast.Call) and n.func is name for n in ast.walk(tree))


TOKENS = [
    "a", "b", "c", "1", "2.5", "0", "1e3",
    "+", "-", "*", "/", "^", "(", ")", ",",
    *FUNCTIONS,
    # what must never get through
    "**", "%", "//", "@", "|", "&", "~", "<", "==", "and", "not", "if", "else", "for", "in",
    "lambda", ":", ":=", ".", "[", "]", "{", "}", "'s'", "True", "None", "1j", "=", ";",
    "open", "__import__", "eval", "exec", "os", "system", "__class__", "getattr", "x", "key",
]  # fmt: skip


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(TOKENS), min_size=1, max_size=12),
    st.fixed_dictionaries({n: st.floats(-5, 5, allow_nan=False) for n in NAMES}),
)
def test_token_soup_compiles_only_within_the_whitelist(tokens: list[str], values: dict[str, float]) -> None:
    text = " ".join(tokens)
    try:
        formula = compile_formula(text, NAMES)
    except FormulaSyntaxError:
        assert not within_whitelist(text) or len(text) > 2000
        return
    assert within_whitelist(text), text
    try:
        result = formula.evaluate(values)
    except FormulaRuntimeError:
        return
    assert isinstance(result, float) and math.isfinite(result)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_text_never_escapes(text: str) -> None:
    try:
        formula = compile_formula(text, NAMES)
    except FormulaSyntaxError:
        return
    assert within_whitelist(text), text
    try:
        assert math.isfinite(formula.evaluate(VALUES))
    except FormulaRuntimeError:
        pass


# Random well-formed expressions, rendered fully parenthesized, against a direct evaluation.

Expr = tuple[str, Any]


def _number_text(value: float) -> str:
    return repr(value)


leaves = st.one_of(
    st.sampled_from(NAMES).map(lambda n: ("name", n)),
    st.floats(0, 100, allow_nan=False, allow_infinity=False).map(lambda v: ("number", v)),
    st.integers(0, 9).map(lambda v: ("number", float(v))),
)


def _extend(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    return st.one_of(
        st.tuples(st.sampled_from("+-*/^"), children, children).map(lambda t: ("binary", t)),
        children.map(lambda c: ("negate", c)),
        st.tuples(st.sampled_from(["abs", "floor", "ceil", "exp", "sqrt", "log"]), children).map(
            lambda t: ("call", (t[0], [t[1]]))
        ),
        st.tuples(st.sampled_from(["min", "max"]), st.lists(children, min_size=1, max_size=3)).map(
            lambda t: ("call", t)
        ),
        st.tuples(st.just("log"), children, children).map(lambda t: ("call", ("log", [t[1], t[2]]))),
    )


expressions = st.recursive(leaves, _extend, max_leaves=12)


def to_text(expr: Expr) -> str:
    kind, value = expr
    if kind == "name":
        return str(value)
    if kind == "number":
        return _number_text(value)
    if kind == "negate":
        return f"(-{to_text(value)})"
    if kind == "binary":
        op, left, right = value
        return f"({to_text(left)} {op} {to_text(right)})"
    name, args = value
    return f"{name}({', '.join(to_text(a) for a in args)})"


REFERENCE: dict[str, Callable[..., float]] = {
    "abs": abs,
    "floor": lambda x: float(math.floor(x)),
    "ceil": lambda x: float(math.ceil(x)),
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": lambda x, base=None: math.log(x) if base is None else math.log(x, base),
    "min": lambda *xs: min(xs),
    "max": lambda *xs: max(xs),
}


def reference(expr: Expr, values: dict[str, float]) -> float:
    kind, value = expr
    if kind == "name":
        return values[value]
    if kind == "number":
        return float(value)
    if kind == "negate":
        return -reference(value, values)
    if kind == "binary":
        op, left, right = value
        x, y = reference(left, values), reference(right, values)
        if op == "+":
            return x + y
        if op == "-":
            return x - y
        if op == "*":
            return x * y
        if op == "/":
            return x / y
        return math.pow(x, y)
    name, args = value
    return float(REFERENCE[name](*(reference(a, values) for a in args)))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expressions, st.fixed_dictionaries({n: st.floats(-10, 10, allow_nan=False) for n in NAMES}))
def test_whitelisted_expressions_agree_with_a_reference(expr: Expr, values: dict[str, float]) -> None:
    text = to_text(expr)
    formula = compile_formula(text, NAMES)
    expected: float | None
    try:
        value = reference(expr, values)
        expected = value if math.isfinite(value) else None
    except (ZeroDivisionError, ValueError, OverflowError):
        expected = None
    if expected is None:
        with pytest.raises(FormulaRuntimeError):
            formula.evaluate(values)
    else:
        assert formula.evaluate(values) == pytest.approx(expected, rel=1e-12, abs=1e-300)


FORBIDDEN_LEAVES = [
    "a.real",
    "a[0]",
    "__import__('os')",
    "open('x')",
    "(lambda: 1)()",
    "[x for x in (a, b)][0]",
    "(a if b else c)",
    "(a < b)",
    "'1'",
    "True",
    "getattr(a, 'real')",
    "a ** 2",
    "(a % 2)",
    "sum((a, b))",
]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expressions, st.sampled_from(FORBIDDEN_LEAVES), st.integers(0, 1000))
def test_one_forbidden_piece_anywhere_refuses_the_whole_formula(expr: Expr, piece: str, where: int) -> None:
    text = to_text(expr)
    # Replace one leaf occurrence (a name or a number) by the forbidden piece.
    tree = ast.parse(text.replace("^", "**"), mode="eval")
    leaves_found = [n for n in ast.walk(tree) if isinstance(n, ast.Name | ast.Constant)]
    target = leaves_found[where % len(leaves_found)]
    segment = ast.get_source_segment(text.replace("^", "**"), target)
    assert segment is not None
    start = _offset(text, target)
    poisoned = text[:start] + f"({piece})" + text[start + len(segment) :]
    with pytest.raises(FormulaSyntaxError):
        compile_formula(poisoned, NAMES)


def _offset(text: str, node: ast.expr) -> int:
    # `^` and `**` differ in length: map the node's column in the `**` text back to the `^` text.
    converted = text.replace("^", "**")
    column = node.col_offset
    return column - (converted[:column].count("**"))
