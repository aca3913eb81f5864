"""A safe arithmetic evaluator for the ``multi`` grader's ``calculate_output``.

``0.7 * correct + 0.3 * format`` combines named sub-grader scores. Only this is accepted:
numbers, the given names, ``+ - * / **`` and unary minus, parentheses, and calls of
``min max abs round sqrt log exp floor ceil`` with positional arguments. Nothing reaches
Python's ``eval``: the text is parsed with :mod:`ast` and the tree walked here, so attribute
access, subscripts, comprehensions, lambdas and every other name are refused when the spec is
validated (:func:`check_expression`), not when it runs. Arithmetic is in floats; an overflow,
a division by zero or a value outside a function's domain is an :class:`ExpressionError`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Collection, Mapping

__all__ = ["FUNCTIONS", "MAX_EXPRESSION_CHARS", "ExpressionError", "check_expression", "evaluate"]

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 64.0

FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "round": round,
    "sqrt": math.sqrt,
    "log": math.log,
    "exp": math.exp,
    "floor": math.floor,
    "ceil": math.ceil,
}
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


class ExpressionError(ValueError):
    """An expression that is not allowed, or that cannot be computed for these values."""


def _parse(text: str) -> ast.expr:
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expressions are at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not a valid expression: {exc.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ExpressionError(f"expressions have at most {MAX_NODES} parts")
    return tree.body


def _check(node: ast.expr, names: Collection[str]) -> None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ExpressionError(f"only numbers are allowed as constants, not {node.value!r:.40}")
    elif isinstance(node, ast.Name):
        if node.id not in names:
            known = ", ".join(sorted(names)) or "none"
            raise ExpressionError(f"unknown name {node.id!r} (the sub-graders are: {known})")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        _check(node.left, names)
        _check(node.right, names)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, ast.USub | ast.UAdd):
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        _check(node.operand, names)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise ExpressionError(f"only these functions may be called: {', '.join(FUNCTIONS)}")
        if node.keywords or not node.args:
            raise ExpressionError(f"{node.func.id}() takes positional arguments only")
        for arg in node.args:
            _check(arg, names)
    else:
        raise ExpressionError(f"{type(node).__name__} is not allowed in an expression")


def check_expression(text: str, names: Collection[str]) -> str:
    """``text`` when it is an allowed expression over ``names``; else ExpressionError."""
    _check(_parse(text), names)
    return text


def _eval(node: ast.expr, values: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)  # _check allows only numbers
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id])
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, values), _eval(node.right, values)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ExpressionError(f"exponents are at most {MAX_EXPONENT:g} in size")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):  # a negative number to a fractional power
            raise ExpressionError(f"{left:g} ** {right:g} is not a real number")
        return result
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, values)
        return -value if isinstance(node.op, ast.USub) else value
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return float(FUNCTIONS[node.func.id](*(_eval(a, values) for a in node.args)))


def evaluate(text: str, values: Mapping[str, float]) -> float:
    """The value of the expression ``text`` with ``values`` for its names (checked first)."""
    node = _parse(text)
    _check(node, values.keys())
    try:
        result = _eval(node, values)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as exc:
        raise ExpressionError(f"cannot compute {text!r:.60}: {exc}") from None
    if not math.isfinite(result):
        raise ExpressionError(f"{text!r:.60} is not a finite number here")
    return float(result)
