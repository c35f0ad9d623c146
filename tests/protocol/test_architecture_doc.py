"""docs/architecture.md carries the request machine's table as the table is."""

from __future__ import annotations

from pathlib import Path

from pdtrio.protocol.request.drawing import BEGIN, END, machine_table, with_table
from pdtrio.protocol.request.events import FirstToken
from pdtrio.protocol.request.machine import TABLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_architecture_doc_draws_the_machines_table_as_it_is() -> None:
    document = DOC.read_text()
    assert BEGIN in document and END in document
    assert with_table(document) == document, (
        "docs/architecture.md's machine table is stale: "
        "python -m tests.protocol.test_architecture_doc draws it again"
    )


def test_every_entry_of_the_tables_is_a_row() -> None:
    def rows(first_token: FirstToken) -> list[str]:
        return machine_table(TABLES[first_token]).splitlines()[2:]  # (below the header)

    # 31 phase-specific entries (6 of them deadlines), 5 for any phase
    assert len(rows(FirstToken.FROM_PREFILL)) == 31 + 5
    # no waiting for a decode (4 entries fewer), 9 for a prefill failing beside decode
    assert len(rows(FirstToken.FROM_DECODE)) == 31 - 4 + 9 + 5


if __name__ == "__main__":
    DOC.write_text(with_table(DOC.read_text()))
