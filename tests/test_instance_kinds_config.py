"""[[instances]] kind: pdtrio workers, or vLLM / SGLang engines the router fronts."""

from __future__ import annotations

from typing import Any

import pytest

from pdtrio.config import ConfigError, WorkerConfig, config_from_dict


def _pool(*instances: dict[str, Any]) -> dict[str, Any]:
    return {"instances": list(instances)}


def test_the_kind_defaults_to_pdtrio_and_a_pdtrio_list_fronts_no_engine() -> None:
    config = config_from_dict(
        _pool({"role": "prefill", "url": "http://a"}, {"role": "decode", "url": "http://b"})
    )
    assert [i.kind for i in config.instances] == ["pdtrio", "pdtrio"]
    assert config.engine_kind is None


def test_a_vllm_pair_is_an_engine_pool_with_its_model_and_key() -> None:
    config = config_from_dict(
        _pool(
            {
                "role": "prefill",
                "url": "http://a",
                "kind": "vllm",
                "api_key": "sk-front-7",
                "model": "m",
            },
            {"role": "decode", "url": "http://b", "kind": "vllm"},
        )
    )
    assert config.engine_kind == "vllm"
    assert config.instances[0].api_key == "sk-front-7"
    assert "sk-front-7" not in repr(config.instances[0])  # a credential stays out of logs


def test_kinds_that_cannot_pair_are_refused_naming_each_side() -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(
            _pool(
                {"role": "prefill", "url": "http://a", "kind": "vllm"},
                {"role": "decode", "url": "http://b"},
            )
        )
    message = str(caught.value)
    assert "vLLM: prefill http://a" in message and "pdtrio: decode http://b" in message
    assert "cannot pair" in message


@pytest.mark.parametrize(
    ("instances", "words"),
    [
        ([{"role": "prefill", "url": "http://a", "kind": "vllm"}], "no vLLM decode"),
        ([{"role": "decode", "url": "http://a", "kind": "vllm"}], "no vLLM prefill"),
        (
            [
                {"role": "prefill", "url": "http://a", "kind": "sglang"},
                {"role": "decode", "url": "http://b", "kind": "sglang"},
            ],
            "needs bootstrap_port",
        ),
        (
            [
                {"role": "prefill", "url": "http://a", "kind": "vllm", "bootstrap_port": 8998},
                {"role": "decode", "url": "http://b", "kind": "vllm"},
            ],
            "bootstrap_port is SGLang's",
        ),
        (
            [
                {"role": "prefill", "url": "http://a", "api_key": "k"},
                {"role": "decode", "url": "http://b"},
            ],
            "model and api_key are for engines",
        ),
        ([{"role": "both", "url": "http://a", "kind": "tgi"}], "instances[0].kind"),
    ],
)
def test_an_engine_entry_missing_what_it_needs_is_refused(
    instances: list[dict[str, Any]], words: str
) -> None:
    with pytest.raises(ConfigError, match="invalid configuration") as caught:
        config_from_dict(_pool(*instances))
    assert words in str(caught.value)


def test_listed_engines_and_etcd_are_of_one_kind() -> None:
    etcd = {"etcd_endpoints": ["http://127.0.0.1:2379"]}
    with pytest.raises(ConfigError, match="backend is 'pdtrio'.*set backend = \"vllm\""):
        config_from_dict(
            {**_pool({"role": "both", "url": "http://a", "kind": "vllm"}), "discovery": etcd}
        )
    # a listed vLLM prefill and vLLM decodes that register in etcd
    config = config_from_dict(
        {
            **_pool({"role": "prefill", "url": "http://a", "kind": "vllm"}),
            "discovery": {**etcd, "kind": "vllm"},
        }
    )
    assert config.engine_kind == "vllm"


def test_etcd_discovery_of_engines_fronts_them() -> None:
    config = config_from_dict(
        {"discovery": {"etcd_endpoints": ["http://127.0.0.1:2379"], "kind": "sglang"}}
    )
    assert config.engine_kind == "sglang" and not config.uses_embedded_cluster
    assert (
        config_from_dict({"discovery": {"etcd_endpoints": ["http://e:2379"]}}).engine_kind is None
    )


def test_a_worker_registers_as_a_pdtrio_worker() -> None:
    with pytest.raises(ConfigError, match="discovery.backend is the router's"):
        config_from_dict({"discovery": {"kind": "vllm"}}, WorkerConfig)


def test_an_sglang_pair_is_an_engine_pool() -> None:
    config = config_from_dict(
        _pool(
            {"role": "prefill", "url": "http://a", "kind": "sglang", "bootstrap_port": 8998},
            {"role": "decode", "url": "http://b", "kind": "sglang"},
        )
    )
    assert config.engine_kind == "sglang"
    assert config.instances[0].bootstrap_port == 8998
