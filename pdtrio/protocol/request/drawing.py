"""The request machine's table, drawn from the table itself (``docs/architecture.md``
carries it; ``tests/protocol/test_architecture_doc.py`` fails when the two drift)."""

from __future__ import annotations

from collections import defaultdict

from pdtrio.protocol.request.events import Phase
from pdtrio.protocol.request.machine import _TABLE

BEGIN = "<!-- the request machine's table: generated, do not edit -->"
END = "<!-- end of the request machine's table -->"


def machine_table() -> str:
    """The (phase, event) -> handler table as Markdown: one row per phase and event; an
    event every phase after ``NEW`` takes alike is one row."""
    by_entry: dict[tuple[str, str], list[Phase]] = defaultdict(list)
    for (phase, event), handler in _TABLE.items():
        by_entry[(event.__name__, handler.__name__)].append(phase)
    running = [phase for phase in Phase if phase not in (Phase.NEW, Phase.DONE)]
    rows: list[tuple[int, str, str, str]] = []
    for (event_name, handler_name), phases in by_entry.items():
        if sorted(phases, key=_order) == running:
            rows.append((len(Phase), "any but NEW and DONE", event_name, handler_name))
            continue
        rows.extend((_order(phase), phase.name, event_name, handler_name) for phase in phases)
    rows.sort()
    lines = ["| phase | event | handler |", "| --- | --- | --- |"]
    lines += [f"| {phase} | `{event}` | `{handler}` |" for _, phase, event, handler in rows]
    return "\n".join(lines)


def _order(phase: Phase) -> int:
    return list(Phase).index(phase)


def with_table(document: str) -> str:
    """``document`` with the table between its markers drawn afresh."""
    head, _, rest = document.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{machine_table()}\n{END}{tail}"
