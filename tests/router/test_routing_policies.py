"""The router's choices: by the model a request names, and by the configured policies."""

from __future__ import annotations

from pdtrio.config import RouterConfig, SyntheticEngineConfig, WorkerConfig
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.worker.server import Worker
from tests.cluster import client, running_cluster, wait_until_idle, worker_backend


def _worker_of(model: str, role: str) -> Worker:
    engine = SyntheticEngine(
        SyntheticEngineConfig(), num_blocks=1024, block_size=16, model_name=model
    )
    return Worker(WorkerConfig(role=role), engine)  # type: ignore[arg-type]


async def test_requests_go_to_the_instances_of_the_model_they_name() -> None:
    roles = ("prefill", "decode", "prefill", "decode")
    models = iter(["alpha", "alpha", "beta", "beta"])

    def make(role: str) -> Worker:
        return _worker_of(next(models), role)

    async with running_cluster(roles=roles, make_worker=make) as cluster:
        alpha_prefill, alpha_decode, beta_prefill, beta_decode = cluster.workers
        async with client(cluster) as http:
            listed = (await http.get("/v1/models")).json()["data"]
            assert sorted(m["id"] for m in listed) == ["alpha", "beta"]
            for model, times in (("alpha", 3), ("beta", 2)):
                for _ in range(times):
                    response = await http.post(
                        "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3}
                    )
                    assert response.status_code == 200, response.text
                    assert response.json()["model"] == model
        assert (alpha_prefill.prefill.served_prefills, beta_prefill.prefill.served_prefills) == (
            3,
            2,
        )
        router = cluster.router_app.router
        assert router is not None
        # each decode took only its model's requests (its link's frames say so)
        frames = {
            worker.instance_id: worker_backend(router)
            .instances[worker.instance_id]
            .link.statistics()
            .frames_received  # type: ignore[union-attr]
            for worker in (alpha_decode, beta_decode)
        }
        assert all(frames.values()), frames
        await wait_until_idle(cluster)


async def test_round_robin_prefill_takes_each_instance_in_turn() -> None:
    async with running_cluster(
        roles=("prefill", "prefill", "prefill", "decode"),
        router=RouterConfig(prefill_policy="round_robin"),
    ) as cluster:
        prefills = cluster.workers[:3]
        async with client(cluster) as http:
            for _ in range(9):
                body = {"model": "synthetic", "prompt": "hi", "max_tokens": 2}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert [p.prefill.served_prefills for p in prefills] == [3, 3, 3]


async def test_power_of_two_spreads_the_load() -> None:
    async with running_cluster(
        roles=("prefill", "prefill", "decode", "decode"),
        router=RouterConfig(prefill_policy="power_of_two", decode_policy="power_of_two"),
    ) as cluster:
        async with client(cluster) as http:
            for _ in range(12):
                body = {"model": "synthetic", "prompt": "hi", "max_tokens": 2}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert all(p.prefill.served_prefills for p in cluster.workers[:2])
        await wait_until_idle(cluster)
