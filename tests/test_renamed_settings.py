"""One name for one thing: the renamed keys, tables, flags and variables (issue 51).

A file, flag or variable of the previous release still works for one release, with one
WARNING naming the new name; giving the old name and the new one together is refused,
naming both.  The worker's settings are the ``[worker]`` table in the router's file and
in the file ``pdtrio worker --config`` reads.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

from pdtrio.config import (
    ConfigError,
    InstanceConfig,
    PdtrioConfig,
    WorkerConfig,
    config_from_json,
    config_to_json,
    load_config_file,
)
from pdtrio.worker.main import parse_args

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _file(tmp_path: Path, text: str, name: str = "pdtrio.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


ROUTER_NEW = """
[discovery]
etcd_endpoints = ["http://127.0.0.1:2379"]
backend = "vllm"

[[instances]]
role = "prefill"
url = "http://a"
backend = "vllm"

[[instances]]
role = "decode"
url = "http://b"
backend = "vllm"

[worker]
worker_secret_file = "/run/secret"
worker_tls_ca_file = "/etc/ca.pem"

[worker.engine]
kind = "synthetic"
num_kv_blocks = 64
"""

ROUTER_OLD = """
[discovery]
etcd_endpoints = ["http://127.0.0.1:2379"]
kind = "vllm"

[[instances]]
role = "prefill"
url = "http://a"
kind = "vllm"

[[instances]]
role = "decode"
url = "http://b"
kind = "vllm"

[embedded.worker]
secret_file = "/run/secret"
tls_ca_file = "/etc/ca.pem"

[embedded.worker.engine]
kind = "synthetic"
num_kv_blocks = 64
"""


def test_a_router_file_in_the_new_names_loads_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config_file(_file(tmp_path, ROUTER_NEW))

    assert config.discovery.kind == "vllm"
    assert [i.kind for i in config.instances] == ["vllm", "vllm"]
    worker = config.embedded.worker
    assert (worker.secret_file, worker.tls_ca_file) == ("/run/secret", "/etc/ca.pem")
    assert (worker.engine.kind, worker.engine.num_kv_blocks) == ("synthetic", 64)
    assert _warnings(caplog) == []


def test_the_old_names_still_load_and_each_warns_with_its_new_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = load_config_file(_file(tmp_path, ROUTER_OLD, "old.toml"))

    assert old == load_config_file(_file(tmp_path, ROUTER_NEW, "new.toml"))
    warned = _warnings(caplog)
    for expected in (
        "config key discovery.kind is deprecated: use discovery.backend",
        "config key instances[0].kind is deprecated: use instances[0].backend",
        "config key instances[1].kind is deprecated: use instances[1].backend",
        "config key worker.secret_file is deprecated: use worker.worker_secret_file",
        "config key worker.tls_ca_file is deprecated: use worker.worker_tls_ca_file",
    ):
        assert expected in warned, warned
    assert any(
        w.startswith("config table [embedded.worker] in ") and "use [worker]" in w for w in warned
    )
    assert len(warned) == 6  # one each, nothing about engine.kind: it keeps its name


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            '[discovery]\nkind = "pdtrio"\nbackend = "pdtrio"\n',
            ("discovery.kind", "discovery.backend"),
        ),
        (
            '[[instances]]\nrole = "both"\nurl = "http://a"\nkind = "vllm"\nbackend = "vllm"\n',
            ("instances[0].kind", "instances[0].backend"),
        ),
        (
            '[worker]\nsecret = "a"\nworker_secret = "b"\n',
            ("worker.secret", "worker.worker_secret"),
        ),
        ("[worker]\n[embedded.worker]\n", ("[embedded.worker]", "[worker]")),
    ],
)
def test_an_old_name_beside_its_new_name_is_refused_naming_both(
    tmp_path: Path, text: str, named: tuple[str, str]
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config_file(_file(tmp_path, text))
    assert all(name in str(raised.value) for name in named), raised.value


def test_a_bad_value_is_named_by_the_key_the_file_wrote(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key 'instances\[0\]\.backend'"):
        load_config_file(
            _file(tmp_path, '[[instances]]\nrole = "both"\nurl = "u"\nbackend = "tgi"\n')
        )
    with pytest.raises(ConfigError, match=r"key 'worker\.engine': num_kv_blocks"):
        load_config_file(_file(tmp_path, "[worker.engine]\nnum_kv_blocks = 0\n"))


def test_the_form_pdtrio_hands_its_processes_round_trips_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config_file(_file(tmp_path, ROUTER_NEW))
    caplog.clear()
    assert config_from_json(config_to_json(config)) == config
    assert _warnings(caplog) == []


WORKER_TABLE = """
[worker]
role = "prefill"
worker_secret_file = "/run/secret"

[worker.engine]
kind = "synthetic"
num_kv_blocks = 32

[worker.discovery]
etcd_endpoints = ["http://127.0.0.1:2379"]
"""


def test_pdtrio_worker_reads_the_same_worker_table_as_the_router(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _file(
        tmp_path, WORKER_TABLE + '\n[router]\ndrain_s = 5\n\n[discovery]\nprefix = "/x/"\n'
    )

    worker, _ = parse_args(["--config", str(path)], {})

    assert (worker.role, worker.secret_file) == ("prefill", "/run/secret")
    assert (worker.engine.kind, worker.engine.num_kv_blocks) == ("synthetic", 32)
    # the file's [discovery] is the router's: the worker's is [worker.discovery]
    assert worker.discovery.prefix == WorkerConfig().discovery.prefix
    assert _warnings(caplog) == []
    # one file for a whole deployment: the router reads its [worker] as its embedded workers'
    router = load_config_file(path)
    assert router.embedded.worker.engine == worker.engine


def test_a_worker_file_of_the_previous_release_still_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = """role = "prefill"\nsecret_file = "/run/secret"\n\n[engine]\nkind = "synthetic"\n"""
    path = _file(tmp_path, old)

    worker, _ = parse_args(["--config", str(path)], {})

    assert (worker.role, worker.secret_file, worker.engine.kind) == (
        "prefill",
        "/run/secret",
        "synthetic",
    )
    warned = _warnings(caplog)
    assert any("top level of" in w and "under [worker]" in w for w in warned), warned
    assert "config key worker.secret_file is deprecated: use worker.worker_secret_file" in warned


def test_worker_keys_outside_the_worker_table_are_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, 'role = "decode"\n' + WORKER_TABLE)
    with pytest.raises(ConfigError, match=r"role outside it"):
        parse_args(["--config", str(path)], {})


@pytest.mark.parametrize(
    ("old", "new", "value", "read"),
    [
        ("--kv-blocks", "--num-kv-blocks", "77", lambda c: c.engine.num_kv_blocks == 77),
        ("--engine", "--engine-kind", "synthetic", lambda c: c.engine.kind == "synthetic"),
        ("--secret-file", "--worker-secret-file", "/s", lambda c: c.secret_file == "/s"),
        ("--tls-ca-file", "--worker-tls-ca-file", "/ca", lambda c: c.tls_ca_file == "/ca"),
    ],
)
def test_an_old_flag_still_works_warns_and_is_refused_beside_the_new_one(
    old: str, new: str, value: str, read: object, caplog: pytest.LogCaptureFixture
) -> None:
    for argv in ([new, value], [old, value]):
        config, _ = parse_args(argv, {})
        assert read(config)  # type: ignore[operator]
    assert _warnings(caplog) == [f"flag {old} is deprecated: use {new}"]
    with pytest.raises(ConfigError, match=f"{old} and {new} are one setting"):
        parse_args([old, value, new, value], {})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("PDTRIO_KV_BLOCKS", "PDTRIO_NUM_KV_BLOCKS"),
        ("PDTRIO_ENGINE", "PDTRIO_ENGINE_KIND"),
        ("PDTRIO_TLS_CA_FILE", "PDTRIO_WORKER_TLS_CA_FILE"),
    ],
)
def test_an_old_variable_still_works_warns_and_is_refused_beside_the_new_one(
    old: str, new: str, caplog: pytest.LogCaptureFixture
) -> None:
    value = {"PDTRIO_KV_BLOCKS": "9", "PDTRIO_ENGINE": "synthetic"}.get(old, "/ca")
    assert parse_args([], {old: value})[0] == parse_args([], {new: value})[0]
    assert _warnings(caplog) == [f"environment variable {old} is deprecated: use {new}"]
    with pytest.raises(ConfigError, match=f"{old} and {new} are one setting"):
        parse_args([], {old: value, new: value})


def test_the_shipped_configurations_use_the_new_names(caplog: pytest.LogCaptureFixture) -> None:
    for path in sorted(CONFIGS.glob("*.toml")) + sorted(CONFIGS.glob("multi-host/router.toml")):
        load_config_file(path)
    for name in ("prefill.toml", "decode.toml"):
        parse_args(["--config", str(CONFIGS / "multi-host" / name)], {})
        assert "worker" in tomllib.loads((CONFIGS / "multi-host" / name).read_text())
    assert _warnings(caplog) == []


def test_the_classes_keep_their_attribute_names_this_release() -> None:
    # pdtrio's own processes and code read the attributes; only the files' names changed
    assert InstanceConfig(role="both", url="http://a").kind == "pdtrio"
    assert PdtrioConfig().embedded.worker.secret == ""
