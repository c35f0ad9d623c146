"""The request machine's tables, drawn from the tables themselves (``docs/architecture.md``
carries them; ``tests/protocol/test_architecture_doc.py`` fails when the two drift)."""

from __future__ import annotations

from collections import defaultdict

from pdtrio.protocol.request.events import FirstToken, Phase
from pdtrio.protocol.request.machine import TABLES, Table, event_name

BEGIN = "<!-- the request machine's table: generated, do not edit -->"
END = "<!-- end of the request machine's table -->"

_TITLES = {
    FirstToken.FROM_PREFILL: "Prefill samples the first token (pdtrio's workers)",
    FirstToken.FROM_DECODE: "Decode generates every token (vLLM's KV connector, SGLang's bootstrap)",
}


def machine_tables() -> str:
    """Every backend's table as Markdown, under a heading of its own."""
    parts = []
    for first_token, table in TABLES.items():
        parts.append(f"#### {_TITLES[first_token]}\n\n{machine_table(table)}")
    return "\n\n".join(parts)


def machine_table(table: Table) -> str:
    """The (phase, event) -> handler table as Markdown: one row per phase and event; an
    event every phase after ``NEW`` takes alike is one row."""
    by_entry: dict[tuple[str, str], list[Phase]] = defaultdict(list)
    for (phase, event), handler in table.items():
        by_entry[(event_name(event), handler.__name__)].append(phase)
    running = sorted({phase for phase, _ in table} - {Phase.NEW}, key=_order)
    rows: list[tuple[int, str, str, str]] = []
    for (name, handler_name), phases in by_entry.items():
        if len(phases) > 1 and sorted(phases, key=_order) == running:
            rows.append((len(Phase), "any but NEW and DONE", name, handler_name))
            continue
        rows.extend((_order(phase), phase.name, name, handler_name) for phase in phases)
    rows.sort()
    lines = ["| phase | event | handler |", "| --- | --- | --- |"]
    lines += [f"| {phase} | `{name}` | `{handler}` |" for _, phase, name, handler in rows]
    return "\n".join(lines)


def _order(phase: Phase) -> int:
    return list(Phase).index(phase)


def with_table(document: str) -> str:
    """``document`` with the tables between its markers drawn afresh."""
    head, _, rest = document.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{machine_tables()}\n{END}{tail}"
