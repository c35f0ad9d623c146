"""Log lines: timestamp, process label, level, logger, message; text or JSON; no request
content above DEBUG."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import trio

from pdtrio.logs import (
    ACCESS_LOG_BATCH_LINES,
    LogFormat,
    LogSettingError,
    adopt_hypercorn_error_log,
    configure_logging,
    flush_access_log,
    log_access,
    settings_from_env,
)
from pdtrio.router.lifespan import _flush_access_log_periodically
from tests.cluster import client, running_cluster, wait_for_stats

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<label>\S+) (?P<level>[A-Z]+) "
    r"(?P<logger>\S+): (?P<message>.*)$"
)


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Put the root logger back as it was (configure_logging changes process state)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def test_text_lines_carry_timestamp_label_level_logger_and_message(root_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "text", "router", stream=stream)
    log = logging.getLogger("pdtrio.test")
    log.info("worker %s ready", "prefill-0")
    log.debug("not shown at INFO")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    match = TEXT_LINE.match(lines[0])
    assert match is not None, lines[0]
    assert match.group("label", "level", "logger", "message") == (
        "router",
        "INFO",
        "pdtrio.test",
        "worker prefill-0 ready",
    )


def test_json_lines_carry_the_same_fields_and_extras(root_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("DEBUG", "json", "prefill-0", stream=stream)
    logging.getLogger("pdtrio.test").debug("admitted", extra={"request_id": "r-1", "tokens": 3})
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert TEXT_LINE.pattern  # same fields as the text line, as keys
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record.pop("ts"))
    assert record == {
        "process": "prefill-0",
        "level": "DEBUG",
        "logger": "pdtrio.test",
        "message": "admitted",
        "request_id": "r-1",
        "tokens": 3,
    }


def test_a_second_configuration_replaces_the_first(root_logging: None) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("INFO", "text", "router", stream=first)
    configure_logging("WARNING", "text", "router", stream=second)
    logging.getLogger("pdtrio.test").warning("once")
    assert first.getvalue() == ""
    assert second.getvalue().count("once") == 1


def test_level_and_format_come_from_the_environment() -> None:
    assert settings_from_env({}) == ("INFO", "text")
    environ = {"PDTRIO_LOG_LEVEL": "debug", "PDTRIO_LOG_FORMAT": "json"}
    assert settings_from_env(environ) == ("DEBUG", "json")
    with pytest.raises(LogSettingError, match="PDTRIO_LOG_LEVEL|log level 'loud'"):
        settings_from_env({"PDTRIO_LOG_LEVEL": "loud"})
    with pytest.raises(LogSettingError, match="log format 'xml'"):
        settings_from_env({"PDTRIO_LOG_FORMAT": "xml"})


def test_a_worker_says_what_it_does_at_start_in_its_own_name() -> None:
    command = [sys.executable, "-m", "pdtrio", "worker", "--engine-kind", "synthetic"]
    command += ["--instance-id", "decode-7", "--role", "decode", "--kv-transport", "tcp"]
    command += ["--log-format", "json", "--exit-with-stdin"]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stdin is not None
    ready = process.stdout.readline()
    # closing its stdin (the supervisor's pipe) stops the worker
    _, stderr = process.communicate(b"", timeout=30)
    assert ready.startswith(b"PDTRIO_READY "), stderr.decode()
    records = [json.loads(line) for line in stderr.decode().splitlines()]
    assert {record["process"] for record in records} == {"decode-7"}
    messages = [record["message"] for record in records]
    expected = ["loading the synthetic engine", "model loaded in", "KV transport: tcp"]
    expected.append("serving as decode-7 on http://127.0.0.1:")
    found = [next(i for i, m in enumerate(messages) if m.startswith(e)) for e in expected]
    assert found == sorted(found), messages  # in the order it does them
    assert "KV cache: 1024 blocks of 16 tokens" in messages[found[1]]


async def test_request_content_is_not_logged_above_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "the-prompt-text-that-must-not-leak"
    caplog.set_level(logging.DEBUG)
    async with running_cluster() as cluster, client(cluster) as http:
        ok = await http.post(
            "/v1/chat/completions",
            json={
                "model": "synthetic",
                "messages": [{"role": "user", "content": secret}],
                "max_tokens": 4,
                "stream": True,
            },
        )
        assert ok.status_code == 200
        refused = await http.post(
            "/v1/completions", json={"model": "synthetic", "prompt": secret, "n": 17}
        )
        assert refused.status_code == 400
    leaks = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]
    assert leaks  # the cluster did log something
    assert not [m for m in leaks if secret in m]


def test_hypercorns_error_log_goes_through_ours_even_when_it_starts_later(
    root_logging: None,
) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "text", "router", stream=stream)
    hypercorn = logging.getLogger("hypercorn.error")
    filters = list(hypercorn.filters)
    adopt_hypercorn_error_log()
    try:
        # what hypercorn does when its logger is first used, after the app started
        hypercorn.handlers = [logging.StreamHandler(sys.stderr)]
        hypercorn.setLevel(logging.INFO)
        hypercorn.info("Running on http://127.0.0.1:8000")
        assert hypercorn.handlers == []
        (line,) = stream.getvalue().splitlines()
        assert line.endswith(" router INFO hypercorn.error: Running on http://127.0.0.1:8000")
    finally:
        hypercorn.filters = filters
        hypercorn.handlers = []
        hypercorn.setLevel(logging.NOTSET)


def test_access_lines_are_written_in_batches_and_in_order(root_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "text", "router", stream=stream)
    access = logging.getLogger("pdtrio.access")
    access.info("request_id=a status=200")
    access.info("request_id=b status=200")
    assert stream.getvalue() == ""  # waiting: one write per request was a system call each
    logging.getLogger("pdtrio.router").info("something else")
    # another logger's line goes out at once, after the access lines before it
    assert [line.rsplit(": ", 1)[1] for line in stream.getvalue().splitlines()] == [
        "request_id=a status=200",
        "request_id=b status=200",
        "something else",
    ]
    access.info("request_id=c status=200")
    access.warning("request_id=d status=500")  # a warning is not held
    assert stream.getvalue().count("request_id=") == 4
    access.info("request_id=e status=200")
    flush_access_log()
    assert "request_id=e" in stream.getvalue()
    for index in range(ACCESS_LOG_BATCH_LINES):  # a full batch goes without a flush
        access.info("request_id=f%d status=200", index)
    assert stream.getvalue().count("request_id=f") == ACCESS_LOG_BATCH_LINES
    access.info("request_id=g status=200")
    configure_logging("INFO", "text", "router", stream=io.StringIO())  # replaced: flushed
    assert "request_id=g" in stream.getvalue()


async def test_the_router_flushes_access_lines_periodically_and_when_it_stops(
    root_logging: None,
) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "text", "router", stream=stream)
    access = logging.getLogger("pdtrio.access")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_flush_access_log_periodically)
        access.info("request_id=a status=200")
        await wait_for_stats(lambda: "request_id=a" in stream.getvalue(), deadline_s=10)
        access.info("request_id=b status=200")
        nursery.cancel_scope.cancel()
    assert "request_id=b" in stream.getvalue()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_access_line_written_straight_is_the_line_logging_would_write(
    root_logging: None, fmt: LogFormat
) -> None:
    fields = {"request_id": "cmpl-1", "status": 200, "ttft_ms": 1.5, "decode": "decode-0"}
    message = "request_id=cmpl-1 status=200 ttft_ms=1.5 decode=decode-0"
    lines = []
    for straight in (True, False):
        stream = io.StringIO()
        configure_logging("INFO", fmt, "router", stream=stream)
        if straight:
            log_access(message, fields)
        else:
            logging.getLogger("pdtrio.access").info(message, extra=fields)
        flush_access_log()
        lines.append(stream.getvalue())
    straight_line, logged_line = lines
    if fmt == "json":  # the same object, the timestamps aside
        straight_object, logged_object = json.loads(straight_line), json.loads(logged_line)
        assert straight_object.pop("ts")[:16] == logged_object.pop("ts")[:16]
        assert straight_object == logged_object
    else:
        assert straight_line.split(" ", 1)[1] == logged_line.split(" ", 1)[1]


def test_an_access_line_goes_through_logging_when_another_handler_listens(
    root_logging: None, caplog: pytest.LogCaptureFixture
) -> None:
    configure_logging("INFO", "text", "router", stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="pdtrio.access"):
        log_access("request_id=x status=200", {"request_id": "x", "status": 200})
    assert [record.getMessage() for record in caplog.records] == ["request_id=x status=200"]
    assert caplog.records[0].request_id == "x"  # type: ignore[attr-defined]
    configure_logging("WARNING", "text", "router", stream=(stream := io.StringIO()))
    log_access("request_id=y status=200", {"request_id": "y"})
    flush_access_log()
    assert stream.getvalue() == ""  # below the level: nothing
