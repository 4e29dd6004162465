"""Every function in rollstream/ stays readable: at most 120 lines of code (docstring, comments
and blank lines not counted) and at most 10 parameters. A command with more options takes them as one
record (rollstream.app.options)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rollstream"
MAX_LINES, MAX_PARAMS = 120, 10


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    lines = {line for node in body for line in range(node.lineno, node.end_lineno + 1)}
    return sum(1 for line in lines if source[line - 1].strip() and not source[line - 1].strip().startswith("#"))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def _functions():
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}", node, text.splitlines()


def test_no_function_is_longer_than_120_lines_of_code():
    long = {name: n for name, fn, source in _functions() if (n := _code_lines(fn, source)) > MAX_LINES}
    assert long == {}


def test_no_function_or_constructor_takes_more_than_10_parameters():
    wide = {name: n for name, fn, _ in _functions() if (n := _params(fn)) > MAX_PARAMS}
    assert wide == {}


def test_the_checks_count_what_they_claim():
    fn = ast.parse('def f(a, b=1, *c, d, **e):\n    """Doc."""\n    # why\n\n    return a\n').body[0]
    assert (_params(fn), _code_lines(fn, ['', '', '', '', '    return a'])) == (5, 1)
