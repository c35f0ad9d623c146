"""The router wing stays walkable: no module in ``pdtrio/router`` or ``pdtrio/protocol``
over 600 lines, no function there over 80 (data tables are module-level assignments, not
functions, so they are not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pdtrio"
WINGS = ("router", "protocol", "tracing")
MODULE_LINES = 600
FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(path for wing in WINGS for path in (PACKAGE / wing).rglob("*.py"))


def oversized(source: str) -> list[str]:
    """What in ``source`` is over the limits: the module's line count, each long function."""
    found = []
    lines = source.count("\n")
    if lines > MODULE_LINES:
        found.append(f"{lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LINES:
                found.append(f"{node.name}: {length} lines")
    return found


def test_the_check_finds_a_long_function_and_a_long_module() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    long_function = f"def long():\n{body}"
    assert oversized(long_function) == [f"long: {FUNCTION_LINES + 1} lines"]
    assert oversized("x = 1\n" * (MODULE_LINES + 1)) == [f"{MODULE_LINES + 1} lines"]
    assert oversized("def short():\n    return 1\n") == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_or_function_is_over_the_limits(path: Path) -> None:
    assert oversized(path.read_text()) == []
