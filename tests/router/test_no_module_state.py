"""The router keeps no state in its modules: what lives as long as a router does lives on
the ``Router`` or its backend, so two routers in one process (tests, an embedded cluster)
share nothing, and every piece of state has an owner that is torn down with it.

Read from the source with ``ast``: a module (or class body) may bind constants, tuples,
frozensets, read-only mappings, compiled patterns, loggers and type aliases, but no list,
dict or set, no mutable container or metric made by a call, no module-level ``+=`` or call
run for its effect, no ``global`` statement and no ``functools`` cache on a module's
function.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import pdtrio.router

ROUTER_ROOT = Path(pdtrio.router.__file__).resolve().parent

# calls that make a container or a primitive that changes at run time (the last part of
# the name: `collections.defaultdict(...)` and `defaultdict(...)` alike)
MUTABLE_MAKERS = frozenset(
    {
        "dict",
        "list",
        "set",
        "bytearray",
        "defaultdict",
        "OrderedDict",
        "Counter",
        "ChainMap",
        "deque",
        "array",
        "SimpleNamespace",
        "WeakKeyDictionary",
        "WeakValueDictionary",
        "WeakSet",
        "count",
        "Queue",
        "SimpleQueue",
        # a metric or a registry of its own in a module (the router's are RouterMetrics')
        "Gauge",
        "Histogram",
        "Summary",
        "CollectorRegistry",
        # trio's primitives belong to a nursery's lifetime, not the module's
        "Lock",
        "Event",
        "Semaphore",
        "CapacityLimiter",
        "ParkingLot",
        "open_memory_channel",
    }
)
MUTABLE_DISPLAYS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
CACHES = frozenset({"cache", "lru_cache"})
READ_ONCE = frozenset({"__all__", "__slots__"})


def _called_name(node: ast.expr) -> str | None:
    """The last part of what a call calls: ``a.b.c(...)`` -> ``c``."""
    if isinstance(node, ast.Subscript):  # a generic: defaultdict[str, int](...)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, MUTABLE_DISPLAYS):
        return True
    return isinstance(value, ast.Call) and _called_name(value.func) in MUTABLE_MAKERS


def _bindings(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run at import: the body's, and those of its ``if``, ``try`` and
    ``with`` blocks (``if TYPE_CHECKING:``), never a function's."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If | ast.With | ast.For | ast.While):
            yield from _bindings(statement.body + statement.orelse)
        elif isinstance(statement, ast.Try):
            handlers = [line for handler in statement.handlers for line in handler.body]
            yield from _bindings(statement.body + handlers + statement.orelse + statement.finalbody)


def _assigned_value(statement: ast.stmt) -> ast.expr | None:
    if isinstance(statement, ast.Assign | ast.AnnAssign):
        return statement.value
    return None


def _read_once(statement: ast.stmt) -> bool:
    """``__all__`` and ``__slots__``: lists by custom, read by the import system and the
    class machinery, never changed."""
    targets = statement.targets if isinstance(statement, ast.Assign) else []
    return any(isinstance(t, ast.Name) and t.id in READ_ONCE for t in targets)


def module_state(source: str) -> list[str]:
    """Each place ``source`` keeps state at module level, as ``line: what``."""
    tree = ast.parse(source)
    found: list[str] = []
    for statement in _bindings(tree.body):
        value = _assigned_value(statement)
        if value is not None and _mutable(value) and not _read_once(statement):
            found.append(f"{statement.lineno}: a mutable value bound at module level")
        elif isinstance(statement, ast.AugAssign):
            found.append(f"{statement.lineno}: a module-level name changed in place")
        elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            found.append(f"{statement.lineno}: a call at import, for what it changes")
        elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            if any(_called_name(_decorator(d)) in CACHES for d in statement.decorator_list):
                found.append(f"{statement.lineno}: a cache on a module-level function")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{node.lineno}: a global statement")
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                value = _assigned_value(statement)
                if value is not None and _mutable(value) and not _read_once(statement):
                    found.append(f"{statement.lineno}: a mutable class attribute")
    return found


def _decorator(node: ast.expr) -> ast.expr:
    return node.func if isinstance(node, ast.Call) else node


def _router_modules() -> list[Path]:
    return sorted(ROUTER_ROOT.rglob("*.py"))


def test_the_router_package_is_read_whole() -> None:
    names = {path.relative_to(ROUTER_ROOT).as_posix() for path in _router_modules()}
    assert {"core.py", "metrics.py", "request/pipeline.py", "workers/link.py"} <= names


@pytest.mark.parametrize(
    "path", _router_modules(), ids=lambda path: path.relative_to(ROUTER_ROOT).as_posix()
)
def test_a_router_module_keeps_no_state(path: Path) -> None:
    assert module_state(path.read_text()) == []


# what the check must find, each on its own line
_PLANTED = """
import collections, functools, weakref
from prometheus_client import Gauge
from typing import Final

_seen = set()
_by_id: dict[str, int] = {}
_waiting: Final = []
_squares = {n: n * n for n in range(4)}
_tallies = collections.defaultdict(int)
_children = weakref.WeakKeyDictionary()
_hits = collections.Counter()
_live = Gauge("x", "y")
_total = 0
_total += 1
_live.set(1)


@functools.lru_cache(maxsize=64)
def parse(text):
    return text


def bump():
    global _total
    _total += 1


class Table:
    rows = []
    __slots__ = ["name"]


if True:
    _late = list()
"""

# what it must let pass
_ALLOWED = """
import logging
import re
from types import MappingProxyType
from typing import Final, TypeVar

__all__ = ["Router"]
log = logging.getLogger("pdtrio.router")
LIMIT: Final = 4096
NAMES = ("a", "b")
PATHS = frozenset({"/health", "/metrics"})
WORD = re.compile(r"\\w+")
KINDS: Final = MappingProxyType({"chat": 1})
_T = TypeVar("_T")
Pair = tuple[str, int]


def handler(rows: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[str(row)] = counts.get(str(row), 0) + 1
    return counts


class Table:
    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[int] = []
"""


def test_the_check_finds_every_kind_of_planted_state() -> None:
    found = module_state(_PLANTED)
    lines = _PLANTED.splitlines()
    flagged = {lines[int(place.split(":")[0]) - 1].strip() for place in found}
    assert flagged == {
        "_seen = set()",
        "_by_id: dict[str, int] = {}",
        "_waiting: Final = []",
        "_squares = {n: n * n for n in range(4)}",
        "_tallies = collections.defaultdict(int)",
        "_children = weakref.WeakKeyDictionary()",
        "_hits = collections.Counter()",
        '_live = Gauge("x", "y")',
        "_total += 1",
        "_live.set(1)",
        "def parse(text):",
        "global _total",
        "rows = []",
        "_late = list()",
    }


def test_the_check_lets_constants_loggers_and_local_state_pass() -> None:
    assert module_state(_ALLOWED) == []
