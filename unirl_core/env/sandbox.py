"""A bounded evaluator of arithmetic expressions: the calculator tool's sandbox.

Never ``eval``: the text is parsed with ``ast`` and walked by a whitelist. Allowed are number literals (int,
float), unary ``+``/``-``, binary ``+ - * / // % **``, parentheses and calls of a few named math functions
(``abs min max round sqrt floor ceil``). Everything else - names, attributes, subscripts, imports, lambdas,
comprehensions, strings, keyword arguments - is refused with the node's name.

Bounds hold by construction, so no subprocess or signal is needed (and none is safe in a worker thread):
the text length, the node count and the nesting depth are capped before anything is computed; every
integer result must fit in ``max_int_bits`` (a product or power is refused *before* it is computed when
its size bound exceeds the cap, so ``9**9**9`` costs nothing); floats must stay finite. Each operation is
then O(max_int_bits^2) at worst and the walk is O(max_nodes). A wall-clock deadline is checked at every
node as a backstop. Memory is bounded by the same caps (a few hundred small Python numbers).
"""

from __future__ import annotations

import ast
import math
import time
from dataclasses import dataclass

from unirl_core.errors import ConfigError, UniRLError, field_error


class ToolError(UniRLError):
    """The expression is refused or cannot be evaluated; the message is what the model is shown."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Caps of one evaluation."""

    max_chars: int = 200
    """Longest expression text (checked before parsing)."""
    max_nodes: int = 64
    """Most AST nodes."""
    max_depth: int = 16
    """Deepest nesting of AST nodes."""
    max_int_bits: int = 256
    """Largest integer (in bits) of any intermediate result."""
    max_seconds: float = 0.05
    """Wall-clock deadline of one evaluation (a backstop: the other caps already bound the work)."""

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_nodes", "max_depth", "max_int_bits"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 100_000):
                raise field_error(ConfigError, f"limits.{name}", v, "an integer in [1, 100000]",
                                  "use the defaults (200 chars, 64 nodes, depth 16, 256 bits)")
        if not (0 < self.max_seconds <= 10):
            raise field_error(ConfigError, "limits.max_seconds", self.max_seconds, "a value in (0, 10]", "use 0.05")


_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**"}
_FUNCS = {"abs": (1, 1), "min": (2, 4), "max": (2, 4), "round": (1, 2), "sqrt": (1, 1), "floor": (1, 1),
          "ceil": (1, 1)}
"""Allowed functions and their (min, max) argument counts."""


def evaluate(text: str, limits: SandboxLimits | None = None) -> int | float:
    """Value of the arithmetic expression ``text``; raises ``ToolError`` (message for the model) otherwise."""
    lim = limits or SandboxLimits()
    if not isinstance(text, str):
        raise ToolError(f"expression must be text, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > lim.max_chars:
        raise ToolError(f"expression too long ({len(text)} > {lim.max_chars} characters)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"syntax error: {getattr(e, 'msg', None) or type(e).__name__}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > lim.max_nodes:
        raise ToolError(f"expression too large ({nodes} > {lim.max_nodes} nodes)")
    return _Walker(lim).value(tree.body, 1)


def format_number(x: float) -> str:
    """Text of a result: integers exactly, floats to 12 significant digits (integral floats without '.0')."""
    if isinstance(x, int):
        return str(x)
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return format(x, ".12g")


class _Walker:
    def __init__(self, lim: SandboxLimits) -> None:
        self.lim = lim
        self.deadline = time.perf_counter() + lim.max_seconds

    def value(self, node: ast.AST, depth: int) -> int | float:
        if depth > self.lim.max_depth:
            raise ToolError(f"expression nested too deeply (> {self.lim.max_depth})")
        if time.perf_counter() > self.deadline:
            raise ToolError(f"evaluation exceeded {self.lim.max_seconds} s")
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ToolError(f"only numbers are allowed, got {type(v).__name__} {v!r:.20}")
            return self._checked(v)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = self.value(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = self.value(node.left, depth + 1), self.value(node.right, depth + 1)
            return self._binop(_BINOPS[type(node.op)], a, b)
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        raise ToolError(f"'{type(node).__name__}' is not allowed (numbers, + - * / // % **, parentheses and "
                        f"{', '.join(_FUNCS)} only)")

    def _checked(self, v: float) -> int | float:
        if isinstance(v, int):
            if v.bit_length() > self.lim.max_int_bits:
                raise ToolError(f"number too large (> {self.lim.max_int_bits} bits)")
            return v
        if not math.isfinite(v):
            raise ToolError("result is not a finite number")
        return v

    def _binop(self, op: str, a: float, b: float) -> int | float:
        cap = self.lim.max_int_bits
        both_int = isinstance(a, int) and isinstance(b, int)
        if op == "*" and both_int and a.bit_length() + b.bit_length() > cap + 1:
            raise ToolError(f"number too large (> {cap} bits)")
        if op == "**":
            self._check_power(a, b)
        try:
            out = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
                   "//": lambda: a // b, "%": lambda: a % b, "**": lambda: a ** b}[op]()
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result is not a finite number") from None
        if isinstance(out, complex):
            raise ToolError("result is not a real number")
        return self._checked(out)

    def _check_power(self, a: float, b: float) -> None:
        if abs(b) > 10_000:
            raise ToolError("exponent too large")
        if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 \
                and (a.bit_length() - 1) * b > self.lim.max_int_bits:
            raise ToolError(f"number too large (> {self.lim.max_int_bits} bits)")

    def _call(self, node: ast.Call, depth: int) -> int | float:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS:
            name = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise ToolError(f"function '{name}' is not allowed (only {', '.join(_FUNCS)})")
        if node.keywords:
            raise ToolError("keyword arguments are not allowed")
        name = node.func.id
        lo, hi = _FUNCS[name]
        if not lo <= len(node.args) <= hi:
            raise ToolError(f"{name} takes {lo}..{hi} arguments, got {len(node.args)}")
        args = [self.value(a, depth + 1) for a in node.args]
        try:
            if name == "sqrt":
                return self._checked(math.sqrt(args[0]))
            if name in ("floor", "ceil"):
                return self._checked((math.floor if name == "floor" else math.ceil)(args[0]))
            if name == "round" and len(args) == 2:
                if not isinstance(args[1], int) or abs(args[1]) > 20:
                    raise ToolError("round's digits must be an integer in [-20, 20]")
                return self._checked(round(args[0], args[1]))
            return self._checked({"abs": abs, "min": min, "max": max, "round": round}[name](*args))
        except (ValueError, OverflowError) as e:
            raise ToolError(f"{name}: {e}") from None
