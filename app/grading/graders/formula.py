"""The `calculate_output` language of multi graders: arithmetic on sub-scores, checked over Python's AST.

Allowed: numbers, sub-grader names, `+ - * /`, `^` (power), unary minus and plus, parentheses, and the
functions `min max abs floor ceil exp sqrt log`. Everything else (attribute access, subscripts, calls
to any other name, strings, comparisons, lambdas, comprehensions, `**`...) is refused when the formula
is compiled, so nothing outside this list can ever run. The checked tree is turned into closures over
float arithmetic; no `eval`, `exec` or `compile` of the text is involved.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

MAX_LENGTH = 2000
MAX_DEPTH = 64

Evaluator = Callable[[Mapping[str, float]], float]


def _min(*args: float) -> float:
    return min(args)


def _max(*args: float) -> float:
    return max(args)


def _floor(x: float) -> float:
    return float(math.floor(x))


def _ceil(x: float) -> float:
    return float(math.ceil(x))


def _log(x: float, base: float | None = None) -> float:
    return math.log(x) if base is None else math.log(x, base)


# name -> (function, fewest arguments, most arguments or None for any number)
FUNCTIONS: dict[str, tuple[Callable[..., float], int, int | None]] = {
    "min": (_min, 1, None),
    "max": (_max, 1, None),
    "abs": (abs, 1, 1),
    "floor": (_floor, 1, 1),
    "ceil": (_ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "sqrt": (math.sqrt, 1, 1),
    "log": (_log, 1, 2),  # natural log, or log(x, base)
}

ALLOWED = "numbers, sub-grader names, + - * / ^, parentheses and the functions " + " ".join(FUNCTIONS)

_REFUSED_NAMES: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access",
    ast.Subscript: "subscripts",
    ast.Lambda: "lambda",
    ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions",
    ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions",
    ast.Compare: "comparisons",
    ast.BoolOp: "and/or",
    ast.IfExp: "conditional expressions",
    ast.NamedExpr: "assignment expressions",
    ast.JoinedStr: "strings",
    ast.List: "lists",
    ast.Tuple: "tuples",
    ast.Dict: "dicts",
    ast.Set: "sets",
    ast.Starred: "starred arguments",
    ast.Await: "await",
}

_BINARY: dict[type[ast.operator], tuple[str, Callable[[float, float], float]]] = {
    ast.Add: ("+", lambda a, b: a + b),
    ast.Sub: ("-", lambda a, b: a - b),
    ast.Mult: ("*", lambda a, b: a * b),
    ast.Div: ("/", lambda a, b: a / b),
    # math.pow raises on a negative base with a fractional exponent instead of going complex.
    ast.Pow: ("^", math.pow),
}

_OPERATOR_TEXT: dict[type[ast.AST], str] = {
    ast.Mod: "%",
    ast.FloorDiv: "//",
    ast.MatMult: "@",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitOr: "|",
    ast.BitAnd: "&",
    ast.BitXor: "^",
    ast.Not: "not",
    ast.Invert: "~",
}


class FormulaSyntaxError(ValueError):
    """The formula is refused (bad syntax, or something outside the whitelist)."""


class FormulaRuntimeError(ArithmeticError):
    """The formula could not be evaluated on these scores (division by zero, math domain error...)."""


@dataclass(frozen=True)
class Formula:
    source: str
    names: frozenset[str]  # the sub-grader names it reads
    _evaluate: Evaluator

    def evaluate(self, values: Mapping[str, float]) -> float:
        try:
            result = self._evaluate(values)
        except ZeroDivisionError as exc:
            raise FormulaRuntimeError(f"division by zero in {self.source!r}") from exc
        except (ValueError, OverflowError) as exc:
            raise FormulaRuntimeError(f"{exc} in {self.source!r}") from exc
        if not math.isfinite(result):
            raise FormulaRuntimeError(f"{self.source!r} gave {result!r}, not a finite number")
        return float(result)


def compile_formula(source: str, names: Collection[str]) -> Formula:
    """Check `source` against the whitelist and the known sub-grader `names`; raise FormulaSyntaxError."""
    if not isinstance(source, str) or not source.strip():
        raise FormulaSyntaxError("the formula is empty")
    if len(source) > MAX_LENGTH:
        raise FormulaSyntaxError(f"the formula is longer than {MAX_LENGTH} characters")
    if "**" in source:
        raise FormulaSyntaxError("use ^ for powers ('**' is not part of the formula language)")
    # `^` is a power here; in Python it would be xor with a lower precedence than `+`.
    text = source.replace("^", "**")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise FormulaSyntaxError(f"syntax error in {source!r}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise FormulaSyntaxError(f"cannot parse {source!r}: {type(exc).__name__}") from None
    used: set[str] = set()
    evaluate = _compile(tree.body, frozenset(names), used, depth=0)
    return Formula(source=source, names=frozenset(used), _evaluate=evaluate)


def _refuse(node: ast.AST) -> FormulaSyntaxError:
    what = _REFUSED_NAMES.get(type(node))
    if what is None and isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    if what is None:
        what = type(node).__name__
    return FormulaSyntaxError(f"{what} not allowed: a formula uses only {ALLOWED}")


def _compile(node: ast.expr, names: frozenset[str], used: set[str], depth: int) -> Evaluator:
    if depth > MAX_DEPTH:
        raise FormulaSyntaxError(f"the formula is nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) not in (int, float) or not isinstance(value, int | float):
            raise _refuse(node)  # bool, str, bytes, complex, None and Ellipsis are constants too
        try:
            number = float(value)
        except OverflowError:
            raise FormulaSyntaxError(f"the number {value!r} is too large") from None
        if not math.isfinite(number):
            raise FormulaSyntaxError(f"the number {value!r} is not finite")
        return lambda _values: number
    if isinstance(node, ast.Name):
        if node.id in names:
            used.add(node.id)
            key = node.id
            return lambda values: float(values[key])
        if node.id in FUNCTIONS:
            raise FormulaSyntaxError(f"{node.id!r} is a function: call it, e.g. {node.id}(a, b)")
        known = ", ".join(sorted(names)) or "none"
        raise FormulaSyntaxError(f"unknown name {node.id!r}: the sub-graders are {known}")
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise FormulaSyntaxError(
                f"operator {_OPERATOR_TEXT.get(type(node.op), type(node.op).__name__)!r} not allowed: "
                f"a formula uses only {ALLOWED}"
            )
        apply = op[1]
        left = _compile(node.left, names, used, depth + 1)
        right = _compile(node.right, names, used, depth + 1)
        return lambda values: apply(left(values), right(values))
    if isinstance(node, ast.UnaryOp):
        operand = _compile(node.operand, names, used, depth + 1)
        if isinstance(node.op, ast.USub):
            return lambda values: -operand(values)
        if isinstance(node.op, ast.UAdd):
            return operand
        raise FormulaSyntaxError(
            f"operator {_OPERATOR_TEXT.get(type(node.op), type(node.op).__name__)!r} not allowed: "
            f"a formula uses only {ALLOWED}"
        )
    if isinstance(node, ast.Call):
        return _compile_call(node, names, used, depth)
    raise _refuse(node)


def _compile_call(node: ast.Call, names: frozenset[str], used: set[str], depth: int) -> Evaluator:
    if not isinstance(node.func, ast.Name):
        raise FormulaSyntaxError(f"only the functions {' '.join(FUNCTIONS)} can be called")
    name = node.func.id
    entry = FUNCTIONS.get(name)
    if entry is None:
        raise FormulaSyntaxError(f"unknown function {name!r}: the functions are {' '.join(FUNCTIONS)}")
    if node.keywords:
        raise FormulaSyntaxError(f"{name}() takes no keyword arguments")
    function, fewest, most = entry
    count = len(node.args)
    if count < fewest or (most is not None and count > most):
        if fewest == most:
            expected = f"{fewest}"
        else:
            expected = f"{fewest} or more" if most is None else f"{fewest}-{most}"
        raise FormulaSyntaxError(f"{name}() takes {expected} argument(s), got {count}")
    args = [_compile(arg, names, used, depth + 1) for arg in node.args]
    return lambda values: float(function(*(arg(values) for arg in args)))
