"""docs/configuration.md names every configuration key, with its type and default, and no other.

The sections come from the config classes themselves: walking ``PdtrioConfig``'s
attrs fields, a field that is an attrs class is a section ``[path.name]``, a tuple
of one is an array of tables ``[[path.name]]``, and any other field is a key of its
section; each named as a file writes it (``pdtrio.config.file_section`` and
``file_name``: ``[worker]`` for the classes' ``embedded.worker``, ``backend`` for
an instance's ``kind``). In the doc, a section is a heading whose whole text is its TOML header in
backticks (``### `[router]` ``), followed by one table: ``| key | type | default |
meaning |``. Cells: the key as `` `name` ``; the type as ``float``, ``integer``,
``string``, ``boolean`` or ``one of `"a"`, `"b"` ``; the default as a TOML value in
backticks (words may follow it), ``required`` for a key without one, or ``none``.
"""

from __future__ import annotations

import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest

from pdtrio.config import PdtrioConfig, file_name, file_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
ROOT_SECTION = "(top level)"  # the heading text for keys outside any table, should one appear

_SECTION_HEADING = re.compile(r"^#{1,6}\s+`(\[\[?[^`\]]*\]\]?)`\s*$")
_KEY_CELL = re.compile(r"^`([A-Za-z0-9_-]+)`$")
_CODE_SPAN = re.compile(r"`([^`]+)`")
_COLUMNS = ["key", "type", "default", "meaning"]
_SCALAR_TYPES = {float: "float", int: "integer", str: "string", bool: "boolean"}


@attrs.frozen
class ConfigKey:
    name: str
    type: Any
    default: Any  # attrs.NOTHING: required


@attrs.frozen
class DocRow:
    line: int
    key_cell: str
    type_cell: str
    default_cell: str


# --- the classes -----------------------------------------------------------------------


def _attrs_class_in(tp: Any) -> tuple[type[Any], bool] | None:
    """(class, is an array of tables) when ``tp`` is an attrs class or a tuple of one."""
    if isinstance(tp, type) and attrs.has(tp):
        return tp, False
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = args[0]
        if isinstance(inner, type) and attrs.has(inner):
            return inner, True
    return None


def config_sections(
    cls: type[Any] = PdtrioConfig, path: tuple[str, ...] = (), array: bool = False
) -> dict[str, list[ConfigKey]]:
    """Every section's TOML header -> its keys, in the classes' order."""
    written = file_section(path)
    header = ROOT_SECTION if not path else ("[[{}]]" if array else "[{}]").format(".".join(written))
    hints = typing.get_type_hints(cls)
    sections: dict[str, list[ConfigKey]] = {header: []}
    for field in attrs.fields(cls):
        tp = hints[field.name]
        nested = _attrs_class_in(tp)
        if nested is not None:
            sections.update(config_sections(nested[0], (*path, field.name), nested[1]))
            continue
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        sections[header].append(ConfigKey(file_name(cls, field.name), tp, default))
    return sections


# --- the doc ---------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", inner)]


def doc_sections(text: str) -> tuple[dict[str, list[DocRow]], list[str]]:
    """Each documented section's header -> its table rows; and the problems met reading them."""
    sections: dict[str, list[DocRow]] = {}
    problems: list[str] = []
    current: str | None = None
    table: list[tuple[int, str]] = []
    in_fence = False

    def close() -> None:
        if current is None:
            return
        if not table:
            sections[current] = []
            return
        header = [cell.lower() for cell in _cells(table[0][1])]
        if header != _COLUMNS:
            problems.append(
                f"{current} (line {table[0][0]}): the table's columns must be "
                f"{' | '.join(_COLUMNS)}, not {' | '.join(header)}"
            )
        rows: list[DocRow] = []
        for number, line in table[2:]:
            cells = _cells(line)
            if len(cells) != len(_COLUMNS):
                problems.append(f"{current} (line {number}): {len(cells)} cells, not 4")
                continue
            rows.append(DocRow(number, cells[0], cells[1], cells[2]))
        sections[current] = rows

    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if line.startswith("#"):
            close()
            table = []
            match = _SECTION_HEADING.match(line)
            current = match.group(1) if match else None
            if line.strip("# ") == ROOT_SECTION:
                current = ROOT_SECTION
            if current is not None and current in sections:
                problems.append(f"{current} (line {number}): documented twice")
        elif current is not None and line.lstrip().startswith("|"):
            table.append((number, line))
    close()
    return sections, problems


# --- the comparison --------------------------------------------------------------------


def _expected_type(tp: Any) -> str | None:
    """The type cell a key's type should have (None: any; a type this checker cannot name)."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(f"`{_toml(choice)}`" for choice in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return None
    return _SCALAR_TYPES.get(tp)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _default_problem(key: ConfigKey, cell: str) -> str | None:
    """Why ``cell`` does not render ``key``'s default, or None when it does."""
    default = key.default
    if default is attrs.NOTHING:
        return None if cell == "required" else "it has no default, so the cell must say required"
    if default is None:
        return (
            None if cell.split(" ")[0] == "none" else "the default is None: the cell must say none"
        )
    expected = _toml(list(default) if isinstance(default, tuple) else default)
    match = _CODE_SPAN.match(cell)
    if match is None:
        return f"the default cell must start with the value in backticks: `{expected}`"
    try:
        documented = tomllib.loads(f"value = {match.group(1)}")["value"]
    except tomllib.TOMLDecodeError:
        return f"{match.group(1)} is not a TOML value (the default is `{expected}`)"
    wanted = list(default) if isinstance(default, tuple) else default
    same_type = type(documented) is type(wanted) or (
        type(wanted) is float and type(documented) is int  # `10` is a fine float in TOML
    )
    if not (same_type and documented == wanted):
        return f"documented default {match.group(1)}, but the default is `{expected}`"
    return None


def section_problems(
    header: str, keys: list[ConfigKey], rows: list[DocRow] | None, doc_name: str = "docs"
) -> list[str]:
    """What the doc gets wrong about one section of the classes."""
    if rows is None:
        if not keys:
            return []
        names = ", ".join(k.name for k in keys)
        return [f"{header}: the section is not documented (no '### `{header}`'; keys: {names})"]
    problems: list[str] = []
    documented: dict[str, DocRow] = {}
    for row in rows:
        match = _KEY_CELL.match(row.key_cell)
        if match is None:
            problems.append(
                f"{header} (line {row.line}): the key cell must be `name`, not {row.key_cell!r}"
            )
            continue
        name = match.group(1)
        if name in documented:
            problems.append(f"{header}: key '{name}' is documented twice (line {row.line})")
        documented[name] = row
    existing = {k.name for k in keys}
    for name, extra in documented.items():
        if name not in existing:
            problems.append(
                f"{header}: key '{name}' (line {extra.line}) is documented but does not exist"
            )
    for key in keys:
        found = documented.get(key.name)
        if found is None:
            problems.append(f"{header}: key '{key.name}' is not documented")
            continue
        why = _default_problem(key, found.default_cell)
        if why is not None:
            problems.append(f"{header}: key '{key.name}' (line {found.line}): {why}")
        expected_type = _expected_type(key.type)
        if expected_type is not None and found.type_cell != expected_type:
            problems.append(
                f"{header}: key '{key.name}' (line {found.line}): type cell {found.type_cell!r}, "
                f"expected {expected_type!r}"
            )
    return problems


def extra_section_problems(
    documented: dict[str, list[DocRow]], sections: dict[str, list[ConfigKey]]
) -> list[str]:
    return [
        f"{header}: the doc has this section, but no config class does "
        f"(keys documented: {', '.join(r.key_cell for r in rows) or 'none'})"
        for header, rows in documented.items()
        if header not in sections
    ]


# --- the tests -------------------------------------------------------------------------

SECTIONS = config_sections()


def _doc() -> tuple[dict[str, list[DocRow]], list[str]]:
    return doc_sections(DOC.read_text(encoding="utf-8"))


def test_the_doc_tables_are_well_formed() -> None:
    _, problems = _doc()
    assert not problems, "docs/configuration.md:\n" + "\n".join(problems)


@pytest.mark.parametrize("header", list(SECTIONS))
def test_every_key_of_the_section_is_documented_with_its_default(header: str) -> None:
    documented, _ = _doc()
    problems = section_problems(header, SECTIONS[header], documented.get(header))
    assert not problems, "docs/configuration.md:\n" + "\n".join(problems)


def test_the_doc_names_no_section_that_does_not_exist() -> None:
    documented, _ = _doc()
    problems = extra_section_problems(documented, SECTIONS)
    assert not problems, "docs/configuration.md:\n" + "\n".join(problems)


def test_the_walk_finds_nested_and_array_sections() -> None:
    assert {"[router]", "[[instances]]", "[worker.engine.synthetic]"} <= set(SECTIONS)
    assert [k.name for k in SECTIONS["[[instances]]"]][:3] == ["role", "url", "backend"]
    assert "worker_secret" in [k.name for k in SECTIONS["[worker]"]]
    assert SECTIONS[ROOT_SECTION] == []  # PdtrioConfig holds only sections


_SAMPLE = """\
## Intro

```toml
# not a heading
[router]
```

### `[router]`

| key | type | default | meaning |
|---|---|---|---|
| `drain_s` | float | `10` | drain |
| `typo_s` | float | `1.0` | gone |

### `[gone]`

| key | type | default | meaning |
|---|---|---|---|
| `x` | integer | `1` | x |
"""


def test_a_missing_extra_or_wrong_key_is_named_with_its_section() -> None:
    keys = [
        ConfigKey("drain_s", float, 10.0),
        ConfigKey("max_tokens_limit", int, 5),
        ConfigKey("mode", Literal["a", "b"], "a"),
    ]
    documented, problems = doc_sections(_SAMPLE)
    assert problems == []
    assert set(documented) == {"[router]", "[gone]"}
    found = section_problems("[router]", keys, documented["[router]"])
    assert any("[router]: key 'typo_s'" in p and "does not exist" in p for p in found), found
    assert any("[router]: key 'max_tokens_limit' is not documented" in p for p in found), found
    assert any("[router]: key 'mode' is not documented" in p for p in found), found
    assert not any("drain_s" in p for p in found), found
    extra = extra_section_problems(documented, {"[router]": keys})
    assert len(extra) == 1 and extra[0].startswith("[gone]:")
    missing = section_problems("[embedded]", [ConfigKey("prefill", int, 1)], None)
    assert missing and missing[0].startswith("[embedded]: the section is not documented")


@pytest.mark.parametrize(
    ("key", "cell", "ok"),
    [
        (ConfigKey("a", float, 0.5), "`0.5`", True),
        (ConfigKey("a", float, 10.0), "`10` (seconds)", True),
        (ConfigKey("a", float, 0.5), "`0.25`", False),
        (ConfigKey("a", int, 16 * 1024 * 1024), "`16_777_216` (16 MiB)", True),
        (ConfigKey("a", int, 3), "`3.0`", False),
        (ConfigKey("a", bool, True), "`true`", True),
        (ConfigKey("a", bool, True), "`1`", False),
        (ConfigKey("a", str, "cpu"), '`"cpu"`', True),
        (ConfigKey("a", str, "cpu"), "`cpu`", False),
        (ConfigKey("a", str, ""), '`""`', True),
        (ConfigKey("a", str, attrs.NOTHING), "required", True),
        (ConfigKey("a", str, attrs.NOTHING), '`""`', False),
    ],
)
def test_a_default_cell_must_render_the_default(key: ConfigKey, cell: str, ok: bool) -> None:
    assert (_default_problem(key, cell) is None) is ok
