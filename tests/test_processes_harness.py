"""``pdtrio.testing.Processes`` never hides a failure: a child that dies says why, and a
child that fails unseen is reported when the group closes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdtrio.testing import ProcessError, Processes, Service

PYTHON = sys.executable


def python(code: str) -> list[str]:
    return [PYTHON, "-c", code]


def wait_exited(process: subprocess.Popen[bytes]) -> None:
    """Until ``process`` has exited, leaving it unreaped: as if the test never looked."""
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)


def test_a_worker_that_fails_at_start_says_why(tmp_path: Path) -> None:
    # a configuration mistake: the worker's one clean line, in the harness's error
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    config = {"role": "prefill", "engine": {"kind": "torch", "model": str(model)}}
    with Processes(stop_grace_s=5) as procs, pytest.raises(ProcessError) as raised:
        procs.worker(config, timeout=120)
    message = str(raised.value)
    assert "exited with status 2 before it printed b'PDTRIO_READY '" in message
    assert "config.json is not valid JSON: Expecting property name" in message


def test_a_worker_that_crashes_at_start_raises_with_its_traceback() -> None:
    # a bug of ours while building the engine: its traceback, in the harness's error
    code = (
        "import sys, json\n"
        "import pdtrio.worker.main as worker_main\n"
        "def build_engine(config):\n    return config.no_such_setting\n"
        "worker_main.build_engine = build_engine\n"
        "config = {'role': 'prefill', 'engine': {'kind': 'synthetic'}}\n"
        "sys.exit(worker_main.main(['--config-json', json.dumps(config)]))\n"
    )
    with Processes(stop_grace_s=5) as procs, pytest.raises(ProcessError) as raised:
        process = procs.start(python(code), output="lines")
        procs.read_line(process, b"PDTRIO_READY ", 120)
    message = str(raised.value)
    assert "exited with status 1 before it printed b'PDTRIO_READY '" in message
    assert "Traceback (most recent call last):" in message
    assert "no_such_setting" in message


def test_a_process_that_stays_silent_shows_what_it_printed() -> None:
    code = (
        "import sys, time; print('stuck loading shard 3', file=sys.stderr, flush=True); "
        "print('STARTED', flush=True); time.sleep(60)"
    )
    with Processes(stop_grace_s=5) as procs:
        process = procs.start(python(code), output="lines")
        assert procs.read_line(process, b"STARTED", 30) == b""
        with pytest.raises(ProcessError) as raised:
            procs.read_line(process, b"READY ", 0.5)
    message = str(raised.value)
    assert f"process {process.pid} printed no b'READY ' line within 0.5s" in message
    assert "stuck loading shard 3" in message


def test_a_server_started_discarding_its_output_says_why_it_exited() -> None:
    code = "import sys; print('cannot bind: address in use', file=sys.stderr); sys.exit(4)"
    with Processes(stop_grace_s=5) as procs:
        process = procs.start(python(code), output="discard")
        with pytest.raises(ProcessError) as raised:
            procs.wait_healthy(Service(process, "http://127.0.0.1:9"), timeout=30)
    message = str(raised.value)
    assert "exited with status 4 before it was healthy" in message
    assert "cannot bind: address in use" in message


def test_a_child_that_exits_non_zero_on_its_own_is_reported_at_close() -> None:
    code = "import sys; print('disk full', file=sys.stderr); sys.exit(3)"
    procs = Processes(stop_grace_s=5)
    process = procs.start(python(code))
    wait_exited(process)
    with pytest.raises(ProcessError) as raised:
        procs.close()
    message = str(raised.value)
    assert f"process {process.pid} ({PYTHON} -c " in message
    assert "exited with status 3 on its own" in message
    assert "disk full" in message


def test_a_child_that_fails_when_stopped_is_reported_at_close() -> None:
    code = (
        "import sys, time\n"
        "try:\n    print('UP', flush=True); time.sleep(60)\n"
        "except KeyboardInterrupt:\n    print('shutdown hook crashed', file=sys.stderr); sys.exit(1)\n"
    )
    procs = Processes(stop_grace_s=5)
    process = procs.start(python(code), output="lines")
    procs.read_line(process, b"UP", 30)
    with pytest.raises(ProcessError) as raised:
        procs.close()
    message = str(raised.value)
    assert "exited with status 1 as it was stopped (SIGINT)" in message
    assert "shutdown hook crashed" in message


def test_an_exit_the_test_expected_or_saw_is_not_reported() -> None:
    code = "import sys; sys.exit(86)"
    with Processes(stop_grace_s=5) as procs:
        expected = procs.start(python(code))
        procs.expect_exit(expected)
        seen = procs.start(python(code))
        # a SIGINT that lands while the interpreter is still starting exits 1, not -2:
        # stop the sleepers only once they are up
        sleeper = python("import time; print('UP', flush=True); time.sleep(60)")
        stopped = procs.start(sleeper, output="lines")
        procs.read_line(stopped, b"UP", 30)
        wait_exited(expected)
        assert seen.wait(timeout=30) == 86
        assert procs.stop(stopped) == -2
        running = procs.start(sleeper, output="lines")
        procs.read_line(running, b"UP", 30)
    assert running.returncode == -2  # stopped by the group's own SIGINT: not a failure


def test_a_flood_of_output_never_blocks_the_child() -> None:
    # 8 MiB on each pipe, far past what a pipe holds, and no one reading until it is done
    code = (
        "import sys; block = b'x' * 1023 + b'\\n'\n"
        "for _ in range(8192):\n    sys.stdout.buffer.write(block); sys.stderr.buffer.write(block)\n"
        "sys.stdout.buffer.write(b'END of the flood\\n')\n"
        "sys.stderr.buffer.write(b'the last words\\n'); sys.exit(5)\n"
    )
    with Processes(stop_grace_s=5) as procs:
        for output in ("discard", "lines", "capture"):
            process = procs.start(python(code), output=output)
            assert process.wait(timeout=60) == 5, output
            if output == "lines":
                assert procs.read_line(process, b"END", 10) == b" of the flood"
                with pytest.raises(ProcessError) as raised:
                    procs.read_line(process, b"READY", 10)
                message = str(raised.value)
                assert "the last words" in message
                assert len(message) < 300_000  # a tail, not the flood
            if output == "capture":
                assert len(procs.output(process)) > 16 * 1024 * 1024


def test_a_failure_in_the_block_stays_the_error_and_carries_the_report() -> None:
    code = "import sys; print('disk full', file=sys.stderr); sys.exit(3)"
    with pytest.raises(AssertionError) as raised, Processes(stop_grace_s=5) as procs:
        process = procs.start(python(code))
        wait_exited(process)
        raise AssertionError("the test's own failure")
    assert str(raised.value) == "the test's own failure"
    (note,) = raised.value.__notes__
    assert "exited with status 3 on its own" in note
    assert "disk full" in note
