"""The README and docs/ stay true to the repository: every relative link leads to a file
(and heading) that exists, every command-line flag they quote after a command is one
that command's parser takes, and docs/operating.md names every environment variable the
package reads.

Fast and in-process: the parsers are imported, never run.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def _prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The lines outside fenced code blocks, and the (continuation-joined) lines inside."""
    prose: list[str] = []
    code: list[str] = []
    fenced = False
    pending = ""
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            prose.append(line)
        elif line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            code.append(pending + line)
            pending = ""
    return prose, code


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text, lowercased, without punctuation."""
    text = re.sub(r"`|\*\*|__", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = _prose_and_code(path.read_text())
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose:
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def link_problems(path: Path, text: str | None = None) -> Iterator[str]:
    prose, _ = _prose_and_code(path.read_text() if text is None else text)
    for line in prose:
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            where = f"{path.relative_to(ROOT)}: link {target!r}"
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.is_relative_to(ROOT):
                yield f"{where} leads out of the repository"
                continue
            if not resolved.exists():
                yield f"{where}: no such file"
                continue
            if anchor:
                if resolved.suffix != ".md" or resolved.is_dir():
                    yield f"{where}: an anchor into a file that is not markdown"
                elif anchor not in anchors(resolved):
                    yield f"{where}: {resolved.name} has no heading with that anchor"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    problems = list(link_problems(path))
    assert not problems, "\n".join(problems)


def test_link_checker_catches_a_broken_link() -> None:
    text = (
        "[a](missing.md), [b](operating.md#no-such-heading), [c](../../etc/passwd),\n"
        "[d](#flags), [e](security.md#clients), [f](https://example.com/x.md)\n"
        "```\n[g](not-checked-in-code.md)\n```\n"
    )
    problems = list(link_problems(ROOT / "docs" / "operating.md", text))
    assert problems == [
        "docs/operating.md: link 'missing.md': no such file",
        "docs/operating.md: link 'operating.md#no-such-heading': operating.md has no heading "
        "with that anchor",
        "docs/operating.md: link '../../etc/passwd' leads out of the repository",
    ]


# --- command-line flags -------------------------------------------------------------

_PYTHON = r"python(?:3(?:\.\d+)?)?\s+-m\s+"
# a command whose flags the docs may quote: `pdtrio serve ...`, `python -m pdtrio worker ...`,
# `pdtrio --help`, `python -m benchmarks.engine ...`, `python -m pdtrio.faults ...`
_COMMAND = re.compile(
    rf"(?<![\w./-])(?:(?:{_PYTHON})?pdtrio(?:\s+(serve|worker|register|faults)\b|(?=\s+--))"
    rf"|{_PYTHON}((?:benchmarks|pdtrio)\.[\w.]+))"
)
# where a command's arguments end on a line: another command, a comment, a pipe, a paren
_END = re.compile(r"&&|\|\||[;|#`)]|\s&(?:\s|$)|<<")
_FLAG = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9-]*")


def quoted_commands(text: str) -> Iterator[tuple[str, str]]:
    """(command, the text of its arguments) for each command in code blocks and inline code."""
    prose, code = _prose_and_code(text)
    lines = code + [span for line in prose for _, span in _INLINE_CODE.findall(line)]
    for line in lines:
        for match in _COMMAND.finditer(line):
            subcommand, module = match.group(1), match.group(2)
            command = f"python -m {module}" if module else f"pdtrio {subcommand or ''}".strip()
            rest = line[match.end() :]
            end = _END.search(rest)
            yield command, rest[: end.start()] if end else rest


def quoted_flags(text: str) -> Iterator[tuple[str, str]]:
    for command, arguments in quoted_commands(text):
        for token in arguments.split():
            flag = _FLAG.match(token.strip("[]()'\",{}"))
            if flag:
                yield command, flag.group(0)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _captured_parser(main: Callable[..., object]) -> argparse.ArgumentParser:
    """The parser a module's main() builds: it is stopped at its first parse_args."""

    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> NoReturn:
        raise _Captured(self)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
        mock.patch("sys.argv", ["main"]),
    ):
        try:
            if inspect.signature(main).parameters:
                main([])
            else:
                main()
        except _Captured as captured:
            return captured.parser
    raise AssertionError(f"{main.__module__}.main() parsed no arguments")


def parser_for(command: str) -> argparse.ArgumentParser:
    if command == "pdtrio":
        from pdtrio.__main__ import argument_parser as top

        return top()
    if command == "pdtrio serve":
        from pdtrio.serving.cli import argument_parser as serve

        return serve()
    if command == "pdtrio worker":
        from pdtrio.worker.main import argument_parser as worker

        return worker()
    if command == "pdtrio register":
        from pdtrio.discovery.register_engine import argument_parser as register

        return register()
    if command == "pdtrio faults":
        command = "python -m pdtrio.faults"
    module_name = command.removeprefix("python -m ")
    module = importlib.import_module(module_name)
    if not hasattr(module, "main"):  # a package run by its __main__
        module = importlib.import_module(f"{module_name}.__main__")
    return _captured_parser(module.main)


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def flag_problems(path: Path, text: str | None = None) -> Iterator[str]:
    text = path.read_text() if text is None else text
    for command, flag in quoted_flags(text):
        if command not in _PARSERS:
            _PARSERS[command] = parser_for(command)
        if flag not in _PARSERS[command]._option_string_actions:
            yield f"{path.name}: `{command}` has no flag {flag}"


def _serve_flags_table(text: str) -> Iterator[str]:
    """The flags in the first column of docs/operating.md's "Flags" table."""
    section = text.partition("\n### Flags\n")[2].partition("\n#")[0]
    for line in section.splitlines():
        if line.startswith("| `--"):
            first_column = line.split("|")[1]
            for _, span in _INLINE_CODE.findall(first_column):
                flag = _FLAG.match(span)
                if flag:
                    yield flag.group(0)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_flags_exist(path: Path) -> None:
    problems = list(flag_problems(path))
    assert not problems, "\n".join(problems)


def test_operating_flags_table_is_serves() -> None:
    flags = list(_serve_flags_table((ROOT / "docs" / "operating.md").read_text()))
    assert len(flags) > 15
    serve = parser_for("pdtrio serve")
    missing = [flag for flag in flags if flag not in serve._option_string_actions]
    assert not missing, f"docs/operating.md's flags table names what pdtrio serve lacks: {missing}"


def test_flag_checker_catches_a_flag_that_does_not_exist() -> None:
    text = (
        "Run `pdtrio serve --port 8000 --no-such-flag`, then:\n\n"
        "```sh\n"
        "python -m pdtrio worker --role prefill \\\n"
        "    --kv-blocks 64 --made-up 1 && curl --silent x\n"
        "python -m benchmarks.capacity --quick --bogus  # --fine-in-a-comment\n"
        "```\n"
    )
    assert sorted(quoted_flags(text)) == [
        ("pdtrio serve", "--no-such-flag"),
        ("pdtrio serve", "--port"),
        ("pdtrio worker", "--kv-blocks"),
        ("pdtrio worker", "--made-up"),
        ("pdtrio worker", "--role"),
        ("python -m benchmarks.capacity", "--bogus"),
        ("python -m benchmarks.capacity", "--quick"),
    ]
    problems = list(flag_problems(ROOT / "fake.md", text))
    assert sorted(problems) == [
        "fake.md: `pdtrio serve` has no flag --no-such-flag",
        "fake.md: `pdtrio worker` has no flag --made-up",
        "fake.md: `python -m benchmarks.capacity` has no flag --bogus",
    ]


# --- environment variables ----------------------------------------------------------

_ENV_NAME = re.compile(
    r"PDTRIO_[A-Z0-9_]*[A-Z0-9]|UCX_NET_DEVICES|OMP_WAIT_POLICY|GOMP_SPINCOUNT|PROMETHEUS_MULTIPROC_DIR"
)


def package_environment_variables() -> set[str]:
    """The variables the package reads: string constants that name one, and the worker's
    variable for each flag (PDTRIO_ and the flag's name)."""
    names: set[str] = set()
    for source in (ROOT / "pdtrio").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if _ENV_NAME.fullmatch(node.value):
                    names.add(node.value)
    from pdtrio.worker.main import _OPTIONS

    names.update(option.env for option in _OPTIONS)
    return names


def test_operating_lists_every_environment_variable() -> None:
    names = package_environment_variables()
    assert {"PDTRIO_CONFIG", "PDTRIO_ROLE", "UCX_NET_DEVICES"} <= names
    operating = (ROOT / "docs" / "operating.md").read_text()
    missing = sorted(name for name in names if f"`{name}`" not in operating)
    assert not missing, f"docs/operating.md does not list {missing}"
