"""``pdtrio worker``'s flags, environment and --config: precedence and clear refusals."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pdtrio.config import ConfigError, load_config_file, load_config_from_env
from pdtrio.worker.main import argument_parser, parse_args


def test_flags_beat_the_environment_which_beats_the_config_file(tmp_path: Path) -> None:
    config_file = tmp_path / "worker.toml"
    config_file.write_text(
        '[worker]\nrole = "decode"\nhost = "10.0.0.1"\nport = 9000\n'
        '[worker.engine]\nkind = "synthetic"\nnum_kv_blocks = 64\n'
        '[worker.discovery]\netcd_endpoints = ["http://10.0.0.9:2379"]\nlease_ttl_s = 5\n'
    )
    environ = {"PDTRIO_PORT": "9100", "PDTRIO_NUM_KV_BLOCKS": "128", "PDTRIO_DEVICE": "cuda:1"}
    config, _ = parse_args(["--config", str(config_file), "--num-kv-blocks", "256"], environ)
    assert config.role == "decode"  # from the file
    assert config.host == "10.0.0.1"
    assert config.port == 9100  # the environment over the file
    assert config.engine.num_kv_blocks == 256  # the flag over both
    assert config.engine.device == "cuda:1"
    assert config.discovery.etcd_endpoints == ("http://10.0.0.9:2379",)
    assert config.discovery.lease_ttl_s == 5


def test_addresses_and_etcd_from_flags_and_environment() -> None:
    config, _ = parse_args(
        ["--host", "0.0.0.0", "--transfer-port", "7001", "--advertise-port", "8001"],
        {"PDTRIO_ADVERTISE_HOST": "10.1.2.3", "PDTRIO_ETCD_ENDPOINTS": "http://a:1, http://b:2"},
    )
    assert config.advertised_host == "10.1.2.3"
    assert (config.transfer_port, config.advertise_port) == (7001, 8001)
    assert config.discovery.etcd_endpoints == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bind_needs_an_advertised_address(host: str) -> None:
    with pytest.raises(ConfigError, match="advertise_host") as caught:
        parse_args(["--host", host], {})
    assert "every interface" in str(caught.value)
    config, _ = parse_args(["--host", host, "--advertise-host", "10.0.0.7"], {})
    assert config.advertised_host == "10.0.0.7"


def test_bad_values_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="PDTRIO_PORT"):
        parse_args([], {"PDTRIO_PORT": "eighty"})
    with pytest.raises(ConfigError, match="PDTRIO_ROLE"):
        parse_args([], {"PDTRIO_ROLE": "router"})
    with pytest.raises(ConfigError, match="not found"):
        parse_args(["--config", str(tmp_path / "missing.toml")], {})
    with pytest.raises(ConfigError, match="etcd_endpoints"):
        parse_args(["--etcd", "10.0.0.1:2379"], {})  # no scheme
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        parse_args(["--config-json", '{"discovery": {"lease_ttl_s": 0}}'], {})


def test_every_option_is_described_with_its_default() -> None:
    parser = argument_parser()
    for action in parser._actions:
        if action.dest in ("help", "config_json", "exit_with_stdin", "config"):
            continue
        if action.help == argparse.SUPPRESS:
            continue  # a previous release's flag, hidden (tests/test_renamed_settings.py)
        assert action.help and "default:" in action.help and "env PDTRIO_" in action.help, (
            action.dest
        )


def test_help_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio", "worker", "--help"], capture_output=True, timeout=60
    )
    assert result.returncode == 0
    flags = (b"--advertise-host", b"--transfer-port", b"--num-kv-blocks", b"--device", b"--etcd")
    for flag in flags:
        assert flag in result.stdout


def test_the_router_takes_etcd_endpoints_from_the_environment(tmp_path: Path) -> None:
    config = load_config_from_env({"PDTRIO_ETCD_ENDPOINTS": "http://127.0.0.1:2379"})
    assert config.discovery.etcd_endpoints == ("http://127.0.0.1:2379",)
    assert not config.uses_embedded_cluster
    assert load_config_from_env({}).uses_embedded_cluster
    with pytest.raises(ConfigError, match="PDTRIO_ETCD_ENDPOINTS"):
        load_config_from_env({"PDTRIO_ETCD_ENDPOINTS": "127.0.0.1:2379"})


def test_the_multi_host_example_configurations_load() -> None:
    examples = Path(__file__).parents[2] / "configs" / "multi-host"
    router = load_config_file(examples / "router.toml")
    assert router.discovery.uses_etcd and not router.uses_embedded_cluster
    for name, role in (("prefill.toml", "prefill"), ("decode.toml", "decode")):
        worker, _ = parse_args(["--config", str(examples / name)], {})
        assert worker.role == role and worker.host == "0.0.0.0"
        assert worker.advertised_host != worker.host
        assert worker.discovery.prefix == router.discovery.prefix
        assert worker.discovery.etcd_endpoints == router.discovery.etcd_endpoints


def test_a_bad_value_is_a_config_error_but_a_bug_in_a_class_check_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdtrio import config as config_module

    # the operator's mistakes: one message naming the key
    with pytest.raises(ConfigError, match="key 'drain_s'"):
        config_module.config_from_dict({"drain_s": "soon"}, config_module.WorkerConfig)
    with pytest.raises(ConfigError, match="expected a table of keys"):
        config_module.config_from_dict([1], config_module.WorkerConfig)  # type: ignore[arg-type]

    # a TypeError out of our own class check (WorkerConfig's, which reads this name) is
    # a bug: it comes out as raised, with its traceback, not as a bad key
    monkeypatch.setattr(config_module, "WILDCARD_HOSTS", None)
    with pytest.raises(BaseExceptionGroup) as raised:
        config_module.config_from_dict({"host": "127.0.0.1"}, config_module.WorkerConfig)
    assert raised.group_contains(TypeError)
