"""The calculator sandbox: allowed arithmetic, refused syntax, size / depth / time bounds."""

import time

import pytest

from unirl_core.env.sandbox import SandboxLimits, ToolError, evaluate, format_number
from unirl_core.errors import ConfigError


@pytest.mark.parametrize("expr, value", [
    ("37*48", 1776), ("(1 + 2) * 3 - 4 / 2", 7.0), ("2**10", 1024), ("-7 // 2", -4), ("7 % 3", 1),
    ("abs(-3) + max(1, 5, 2) + min(4, 9)", 12), ("sqrt(16)", 4.0), ("round(2.675, 2)", 2.67),
    ("floor(2.5) + ceil(2.1)", 5), ("2 ** -1", 0.5), ("+3", 3), ("1e3 + 0.5", 1000.5),
])
def test_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, message", [
    ("__import__('os')", "function '__import__' is not allowed"),
    ("__import__('os').system('true')", "function 'Attribute' is not allowed"),
    ("x + 1", "'Name' is not allowed"),
    ("(1).real", "'Attribute' is not allowed"),
    ("[1, 2][0]", "'Subscript' is not allowed"),
    ("(lambda: 1)()", "function 'Lambda' is not allowed"),
    ("[i for i in range(9)]", "'ListComp' is not allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("max(1, key=abs)", "keyword arguments are not allowed"),
    ("open('f')", "function 'open' is not allowed"),
    ("1 if 2 else 3", "'IfExp' is not allowed"),
    ("1 < 2", "'Compare' is not allowed"),
    ("1 << 4", "'BinOp' is not allowed"),
    ("import os", "syntax error"),
    ("1 +", "syntax error"),
    ("", "empty expression"),
])
def test_forbidden_syntax_is_refused_by_name(expr, message):
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expr)


@pytest.mark.parametrize("expr, message", [
    ("9**9**9", "too large"),                  # refused before it is computed
    ("2**300", "too large"),
    ("(2**200) * (2**200)", "too large"),
    ("10.0**400", "not a finite number"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("sqrt(-1)", "sqrt: math domain error"),
    ("(-8) ** 0.5", "not a real number"),
    ("2 ** 100000", "exponent too large"),
    ("floor(1e300)", "too large"),
    ("round(1.5, 99)", "round's digits"),
])
def test_size_and_domain_limits(expr, message):
    t0 = time.perf_counter()
    with pytest.raises(ToolError, match=message):
        evaluate(expr)
    assert time.perf_counter() - t0 < 0.5


def test_text_node_and_depth_limits():
    with pytest.raises(ToolError, match=r"too long \(201 > 200 characters\)"):
        evaluate("1" * 201)
    with pytest.raises(ToolError, match=r"too large \(\d+ > 64 nodes\)"):
        evaluate("+".join(["1"] * 40))
    with pytest.raises(ToolError, match=r"nested too deeply \(> 4\)"):
        evaluate("-(-(-(-(-1))))", SandboxLimits(max_depth=4))
    # parentheses make no nodes; nesting that does is capped by depth before any value is computed
    assert evaluate("(" * 99 + "1" + ")" * 99) == 1
    with pytest.raises(ToolError, match="nested too deeply"):
        evaluate("-" * 150 + "1", SandboxLimits(max_nodes=1000))


def test_deadline_bounds_the_worst_allowed_expression():
    # the most work the caps allow: 256-bit operands multiplied / powered at every node
    worst = "(2**255-1)*(2**255-1)//(2**255-1)*(2**255-1)//(2**255-1)+(2**255-1)%(2**254+1)"
    t0 = time.perf_counter()
    evaluate(worst, SandboxLimits(max_int_bits=512))
    assert time.perf_counter() - t0 < 0.05
    with pytest.raises(ToolError, match=r"exceeded 1e-09 s"):
        evaluate("1+1", SandboxLimits(max_seconds=1e-9))


def test_limits_validation_and_formatting():
    with pytest.raises(ConfigError, match=r"limits.max_nodes=0: expected an integer in \[1, 100000\]"):
        SandboxLimits(max_nodes=0)
    with pytest.raises(ConfigError, match=r"limits.max_seconds=0"):
        SandboxLimits(max_seconds=0)
    assert format_number(1776) == "1776" and format_number(4.0) == "4" and format_number(0.1 + 0.2) == "0.3"
    assert evaluate("  12 *  3 ") == 36
