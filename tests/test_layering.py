"""The package's layering, read from its source: no import cycles, no I/O in the core."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pdtrio

PACKAGE_ROOT = Path(pdtrio.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache  # each file is parsed once for all the tests here, not once per test
def _imports(path: Path) -> frozenset[str]:
    """Every module this file imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from pdtrio.x import y` may name a submodule y
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(found)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    return {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_the_real_package() -> None:
    graph = _graph()
    assert "pdtrio.router.request.pipeline" in graph
    assert "pdtrio.protocol.request" in graph["pdtrio.router.request.pipeline"]


def test_no_import_cycle_anywhere_in_the_package() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _top_level_imports(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _imports(path)}


# What pdtrio/protocol/ may import besides the standard library and itself (README,
# "Layout"): attrs for its values, msgspec for the wire structs and JSON, wsproto for the
# websocket frames it does not cut itself (control frames, fragments, the connection state).
PROTOCOL_THIRD_PARTY = {"attrs", "msgspec", "wsproto"}
# the standard library's I/O modules the core keeps out of too
PROTOCOL_FORBIDDEN_STDLIB = {"asyncio", "socket", "ssl", "selectors", "subprocess", "threading"}


def test_the_sans_io_core_imports_only_the_standard_library_attrs_msgspec_and_wsproto() -> None:
    allowed = (set(sys.stdlib_module_names) - PROTOCOL_FORBIDDEN_STDLIB) | PROTOCOL_THIRD_PARTY
    for path in (PACKAGE_ROOT / "protocol").rglob("*.py"):
        imports = _imports(path)
        ours = {m for m in imports if m.split(".")[0] == "pdtrio"}
        # of the package, only the core itself
        assert all(m == "pdtrio.protocol" or m.startswith("pdtrio.protocol.") for m in ours), (
            path,
            ours,
        )
        others = {m.split(".")[0] for m in imports - ours}
        assert others <= allowed, (path, others - allowed)


def test_the_core_uses_every_library_it_may() -> None:
    """The allowed set says what is true, not what once was: each is imported somewhere."""
    used = set().union(*(_top_level_imports(p) for p in (PACKAGE_ROOT / "protocol").rglob("*.py")))
    assert PROTOCOL_THIRD_PARTY <= used


def test_no_asyncio_and_no_pickle_anywhere() -> None:
    for path in PACKAGE_ROOT.rglob("*.py"):
        assert not _top_level_imports(path) & {"asyncio", "pickle", "cloudpickle"}, path


def test_only_the_torch_engine_imports_torch() -> None:
    torch_package = PACKAGE_ROOT / "engine" / "torch"
    for path in PACKAGE_ROOT.rglob("*.py"):
        if torch_package in path.parents:
            continue
        assert "torch" not in _top_level_imports(path), path


def test_the_router_imports_nothing_of_the_engine() -> None:
    """The router sizes KV by the protocol's arithmetic (``kv_layout.blocks_needed``), so a
    router host needs no engine code."""
    for path in (PACKAGE_ROOT / "router").rglob("*.py"):
        engine = {
            m for m in _imports(path) if m == "pdtrio.engine" or m.startswith("pdtrio.engine.")
        }
        assert not engine, (path, engine)
