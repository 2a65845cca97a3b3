"""Safe arithmetic for the environments: parse with ``ast`` and evaluate numbers and + - * / only.

Model output is untrusted text, so nothing here calls ``eval``: an expression is parsed, every node
is checked against a short allowlist, and the tree is walked by hand.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class BadExpression(ValueError):
    """The text is not an arithmetic expression we evaluate."""


def evaluate(expression: str, max_length: int = 200) -> Fraction:
    """The exact value of ``expression`` (integers, + - * /, parentheses, unary minus)."""
    if len(expression) > max_length:
        raise BadExpression(f"longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise BadExpression(f"not an expression: {exc.msg}") from None
    return _walk(tree.body)


def calculate(expression: str) -> str:
    """What a calculator tool answers: the exact value (a fraction as 6 significant digits), or, for
    a bad expression, an error message, as a real tool gives."""
    try:
        value = evaluate(expression)
    except BadExpression as exc:
        return f"error: {exc}"
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def numbers_in(expression: str) -> list[int]:
    """The integer literals of an expression, in no particular order (for "use each number once" checks)."""
    tree = ast.parse(expression.strip(), mode="eval")
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and type(node.value) is int]


def _walk(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_walk(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise BadExpression("division by zero")
        return _OPS[type(node.op)](left, right)
    raise BadExpression(f"{type(node).__name__} is not allowed (integers, + - * / and parentheses only)")
