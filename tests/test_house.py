"""The package reads top to bottom: no function body (its docstring aside) over 60 lines."""

import ast
import pathlib

import lowmem_aitextgen

PACKAGE = pathlib.Path(lowmem_aitextgen.__file__).parent
MOST_LINES = 60


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of a function's body, its docstring left out."""
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        if len(body) == 1:
            return 0
        first = body[1]
    return node.end_lineno - first.lineno + 1


def test_the_counter_leaves_the_docstring_out():
    tree = ast.parse('def f():\n    """Doc\n    string."""\n    a = 1\n    return a\n')
    assert body_lines(tree.body[0]) == 2


def test_no_function_body_is_over_60_lines():
    long = [f"{path.name}:{node.name} {body_lines(node)}" for path in sorted(PACKAGE.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MOST_LINES]
    assert not long, long
