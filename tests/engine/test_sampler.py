from __future__ import annotations

import math
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from pdtrio.engine.torch.sampler import sample, seeded_uniform  # noqa: E402
from pdtrio.protocol.sampling import SamplingParams  # noqa: E402
from tests.examples import examples  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]])


def draw_many(probs: list[float], n: int, **params: Any) -> Counter[int]:
    """Tokens drawn by n requests with distinct seeds, all in one batch."""
    logits = logits_of(probs).expand(n, -1).contiguous()
    sampling = [SamplingParams(seed=seed, **params) for seed in range(n)]
    return Counter(sample(logits, sampling, [7] * n))


rows = st.integers(min_value=2, max_value=40).flatmap(
    lambda vocab: st.lists(
        st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=vocab, max_size=vocab),
        min_size=1,
        max_size=6,
    )
)
sampling_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    top_k=st.sampled_from([0, 1, 3, 10]),
    seed=st.integers(-(2**63), 2**64),
)


# ---------------------------------------------------------------------- greedy


@settings(max_examples=examples(100), deadline=None)
@given(rows=rows)
def test_greedy_is_argmax(rows: list[list[float]]) -> None:
    logits = torch.tensor(rows)
    tokens = sample(logits, [GREEDY] * len(rows), list(range(len(rows))))
    assert tokens == [max(range(len(r)), key=lambda i: (r[i], -i)) for r in rows]


@settings(max_examples=examples(100), deadline=None)
@given(rows=rows, seed=st.integers(0, 2**32))
def test_top_k_one_and_tiny_top_p_are_greedy(rows: list[list[float]], seed: int) -> None:
    logits = torch.tensor(rows)
    n = len(rows)
    greedy = sample(logits, [GREEDY] * n, [0] * n)
    top_k = sample(logits, [SamplingParams(temperature=1.3, top_k=1, seed=seed)] * n, [0] * n)
    top_p = sample(logits, [SamplingParams(temperature=0.8, top_p=1e-9)] * n, [0] * n)
    assert top_k == greedy and top_p == greedy


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    assert sample(logits, [SamplingParams(temperature=1e-7, seed=1)], [0]) == [1]


# ---------------------------------------------------------------------- determinism


@settings(max_examples=examples(80), deadline=None)
@given(
    data=st.data(),
    rows=rows,
    params=st.lists(sampling_params, min_size=6, max_size=6),
    position=st.integers(0, 10_000),
)
def test_seeded_draw_ignores_batch_composition_and_order(
    data: st.DataObject, rows: list[list[float]], params: list[SamplingParams], position: int
) -> None:
    logits = torch.tensor(rows)
    n = len(rows)
    positions = [position + i for i in range(n)]
    alone = [sample(logits[i : i + 1], [params[i]], [positions[i]])[0] for i in range(n)]
    order = data.draw(st.permutations(range(n)))
    # The batch also holds unrelated unseeded requests, interleaved.
    noise = torch.randn(n, logits.shape[1], generator=torch.Generator().manual_seed(position))
    batch_rows = [logits[i] for i in order] + list(noise)
    batch_params = [params[i] for i in order] + [SamplingParams()] * n
    batch_positions = [positions[i] for i in order] + [0] * n
    together = sample(torch.stack(batch_rows), batch_params, batch_positions)
    assert [together[order.index(i)] for i in range(n)] == alone


def test_seeded_draw_is_inverse_cdf_of_the_keyed_uniform() -> None:
    probs = [0.25, 0.125, 0.5, 0.125]
    # Sorted by probability, ties by id: 2, 0, 1, 3 with CDF 0.5, 0.75, 0.875, 1.
    order, cdf = [2, 0, 1, 3], [0.5, 0.75, 0.875, 1.0]
    for seed in range(200):
        for position in (0, 1, 513):
            u = seeded_uniform(seed, position)
            expected = order[next(i for i, c in enumerate(cdf) if u < c)]
            assert sample(logits_of(probs), [SamplingParams(seed=seed)], [position]) == [expected]


def test_seeded_uniform_is_fixed() -> None:
    # The draw is part of the wire contract between prefill and decode: never change it.
    assert seeded_uniform(0, 0) == 0.6524484863740322
    assert seeded_uniform(1234, 99) == 0.4866784376952785
    assert seeded_uniform(-1, 5) == seeded_uniform(2**64 - 1, 5)
    values = {seeded_uniform(42, p) for p in range(1000)}
    assert len(values) == 1000 and all(0.0 <= v < 1.0 for v in values)


def test_seed_and_position_change_the_draw() -> None:
    probs = [1 / 8] * 8
    by_seed = Counter(sample(logits_of(probs), [SamplingParams(seed=s)], [3])[0] for s in range(64))
    by_position = Counter(
        sample(logits_of(probs), [SamplingParams(seed=9)], [p])[0] for p in range(64)
    )
    assert len(by_seed) > 4 and len(by_position) > 4


def test_unseeded_draws_follow_the_callers_generator() -> None:
    logits = torch.zeros(16, 50)
    params = [SamplingParams()] * 16
    first = sample(logits, params, [0] * 16, generator=torch.Generator().manual_seed(5))
    again = sample(logits, params, [0] * 16, generator=torch.Generator().manual_seed(5))
    other = sample(logits, params, [0] * 16, generator=torch.Generator().manual_seed(6))
    assert first == again != other
    assert all(0 <= t < 50 for t in sample(logits, params, [0] * 16))  # no generator: OS entropy


def test_seeded_rows_ignore_the_generator() -> None:
    logits = torch.zeros(4, 50)
    params = [SamplingParams(seed=s) for s in range(4)]
    a = sample(logits, params, [1, 2, 3, 4], generator=torch.Generator().manual_seed(1))
    b = sample(logits, params, [1, 2, 3, 4], generator=torch.Generator().manual_seed(2))
    assert a == b == sample(logits, params, [1, 2, 3, 4])


# ---------------------------------------------------------------------- distribution


def test_frequencies_follow_probabilities_and_zero_never_appears() -> None:
    counts = draw_many([0.05, 0.6, 0.0, 0.3, 0.05], 4000)
    assert counts[2] == 0
    assert counts[1] > counts[3] > counts[0] > 0 and counts[3] > counts[4] > 0
    assert 0.55 < counts[1] / 4000 < 0.65


def test_temperature_flattens_and_sharpens() -> None:
    probs = [0.7, 0.2, 0.1]
    hot = draw_many(probs, 2000, temperature=3.0)
    cold = draw_many(probs, 2000, temperature=0.3)
    assert cold[0] > 1900 and hot[0] < 1200 and hot[2] > 300


def test_top_k_keeps_only_the_k_most_likely() -> None:
    counts = draw_many([0.1, 0.4, 0.2, 0.3], 1000, top_k=2)
    assert set(counts) == {1, 3}


def test_top_p_keeps_the_smallest_head_reaching_p() -> None:
    # 0.5 + 0.3 reaches 0.7; 0.15 and 0.05 are cut.
    counts = draw_many([0.15, 0.5, 0.05, 0.3], 1000, top_p=0.7)
    assert set(counts) == {1, 3}
    # Exactly reaching p keeps no more than needed.
    counts = draw_many([0.25, 0.5, 0.25], 1000, top_p=0.5)
    assert set(counts) == {1}


def test_top_k_and_top_p_together() -> None:
    counts = draw_many([0.3, 0.25, 0.25, 0.2], 1000, top_k=3, top_p=0.9)
    assert set(counts) == {0, 1, 2}


# ---------------------------------------------------------------------- bans


def test_banned_tokens_are_never_produced() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    params = [GREEDY, SamplingParams(seed=3), GREEDY]
    banned = [frozenset({0}), frozenset({0, 1}), None]
    assert sample(logits, params, [0, 0, 0], banned_token_ids=banned) == [1, 2, 0]
    counts = draw_many([0.9, 0.1], 200)
    assert counts[0] > 0
    logits = logits_of([0.9, 0.1]).expand(200, -1).contiguous()
    tokens = sample(
        logits,
        [SamplingParams(seed=s) for s in range(200)],
        [0] * 200,
        banned_token_ids=[frozenset({0, 99})] * 200,
    )
    assert set(tokens) == {1}


def test_nothing_left_to_sample_is_an_error() -> None:
    with pytest.raises(ValueError, match="no token left"):
        sample(
            torch.zeros(2, 2), [GREEDY, GREEDY], [0, 0], banned_token_ids=[None, frozenset({0, 1})]
        )


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 3), [GREEDY], [0, 0])
    with pytest.raises(ValueError):
        sample(torch.zeros(3), [GREEDY], [0])
    assert sample(torch.zeros(0, 3), [], []) == []


# ---------------------------------------------------------------------- bias, penalties, min-p


def vllm_penalized(
    row: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """vLLM's logits processing, in plain Python: bias, repetition, frequency, presence."""
    out = list(row)
    for token_id, bias in params.logit_bias:
        out[token_id] += bias
    seen = set(prompt) | set(output)
    for t in seen:
        rp = params.repetition_penalty
        out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


penalty_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.8]),
    seed=st.integers(0, 2**32),
    presence_penalty=st.sampled_from([0.0, 1.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.7, -2.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.5]),
    logit_bias=st.sampled_from([(), ((0, 5.0),), ((1, -100.0), (3, 2.0))]),
)


@settings(max_examples=examples(100), deadline=None)
@given(
    row=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=6, max_size=6),
    params=penalty_params,
    prompt=st.lists(st.integers(0, 5), max_size=5),
    output=st.lists(st.integers(0, 5), max_size=5),
)
def test_bias_and_penalties_are_vllms(
    row: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> None:
    expected = vllm_penalized(row, params, prompt, output)
    # the sampler's pick on the processed row is the plain sampler's on vLLM's row
    got = sample(torch.tensor([row]), [params], [9], histories=[(prompt, output)])
    plain = without_adjustments(params)
    assert got == sample(torch.tensor([expected]), [plain], [9])


def without_adjustments(params: SamplingParams) -> SamplingParams:
    return msgspec.structs.replace(
        params, logit_bias=(), presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0
    )


def test_penalties_push_repeated_tokens_down() -> None:
    logits = torch.tensor([[3.0, 2.75, 0.0, -1.0]])
    history = ([5, 0], [0])
    assert sample(logits, [GREEDY], [0]) == [0]
    for penalty in (
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
    ):
        assert sample(logits, [penalty], [0], histories=[history]) == [1]
    biased = SamplingParams(temperature=0.0, logit_bias=((3, 10.0),))
    both = logits.expand(2, -1).contiguous()
    assert sample(both, [biased, GREEDY], [0, 0]) == [3, 0]  # only its own row changes
    assert both.tolist() == [[3.0, 2.75, 0.0, -1.0]] * 2  # the caller's logits are untouched


def test_a_penalizing_row_without_history_is_an_error() -> None:
    with pytest.raises(ValueError, match="history"):
        sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [0])


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    # at temperature 1, min_p 0.25 keeps the tokens with p >= 0.125
    assert set(draw_many(probs, 400, min_p=0.25)) == {0, 1, 2}
    assert set(draw_many(probs, 400, min_p=0.5)) == {0, 1}
    assert set(draw_many(probs, 400, min_p=1.0)) == {0}
    assert set(draw_many(probs, 400)) == {0, 1, 2, 3}
    # temperature flattens first: at 2, p ~ sqrt(p), and 0.05 keeps sqrt(0.05/0.5) > 0.25
    assert set(draw_many(probs, 400, min_p=0.25, temperature=2.0)) == {0, 1, 2, 3}


def test_min_p_on_a_large_vocabulary_follows_the_definition() -> None:
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(1)) * 3
    for seed in range(20):
        params = SamplingParams(seed=seed, min_p=0.1)
        token = sample(logits[:1], [params], [3])[0]
        row = logits[0]
        assert row[token] >= row.max() + math.log(0.1)


# ---------------------------------------------------------------------- large vocabularies


def reference_draw(row: list[float], params: SamplingParams, u: float) -> int:
    """The sampler's definition, in plain Python."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    scaled = [row[i] / params.temperature for i in order]
    if 0 < params.top_k < len(row):
        scaled = scaled[: params.top_k]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    norm = sum(weights)
    probs = [w / norm for w in weights]
    if params.top_p < 1.0:
        kept, mass = [], 0.0
        for prob in probs:
            if kept and mass >= params.top_p:
                break
            kept.append(prob)
            mass += prob
        probs = kept
    target = u * sum(probs)
    mass = 0.0
    for i, prob in enumerate(probs):
        mass += prob
        if mass > target:
            return order[i]
    return order[len(probs) - 1]


def large_rows(n: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    scales = torch.tensor([12.0, 6.0, 3.0, 1.0, 0.3])[torch.arange(n) % 5].unsqueeze(1)
    rows = torch.randn(n, vocab, generator=gen) * scales
    rows[::7, vocab // 2 :] = float("-inf")  # some rows with a banned half
    return rows


LARGE_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=40),
    SamplingParams(top_k=2000),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.5, temperature=1.3),
    SamplingParams(top_k=100, top_p=0.95, temperature=0.8),
]


def test_large_vocabulary_draws_follow_the_definition() -> None:
    n, vocab = 70, 3000
    rows = large_rows(n, vocab)
    params = [
        msgspec.structs.replace(LARGE_PARAMS[i % len(LARGE_PARAMS)], seed=1000 + i)
        for i in range(n)
    ]
    positions = list(range(n))
    tokens = sample(rows, params, positions)
    expected = [
        reference_draw(rows[i].tolist(), params[i], seeded_uniform(1000 + i, i)) for i in range(n)
    ]
    assert tokens == expected


@settings(max_examples=examples(20), deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_large_vocabulary_draw_ignores_batch(data: st.DataObject, seed: int) -> None:
    n, vocab = 10, 2500
    rows = large_rows(n, vocab)
    params = [
        msgspec.structs.replace(data.draw(st.sampled_from(LARGE_PARAMS)), seed=seed + i)
        for i in range(n)
    ]
    alone = [sample(rows[i : i + 1], [params[i]], [i])[0] for i in range(n)]
    order = data.draw(st.permutations(range(n)))
    together = sample(rows[order], [params[i] for i in order], order)
    assert [together[order.index(i)] for i in range(n)] == alone


def test_ties_at_the_head_boundary_break_by_id() -> None:
    vocab = 3000
    row = torch.zeros(1, vocab)
    high = list(range(2990, 3000))
    row[0, high] = 2.0
    logits = row.expand(500, -1).contiguous()
    tokens = sample(logits, [SamplingParams(seed=s, top_k=15) for s in range(500)], [0] * 500)
    # The 10 high logits, then the 5 lowest ids among the equal rest.
    assert set(tokens) <= {*high, 0, 1, 2, 3, 4}
    assert set(tokens) & {0, 1, 2, 3, 4}
    unfiltered = sample(logits, [SamplingParams(seed=s) for s in range(500)], [0] * 500)
    assert set(unfiltered) & set(high) and len(set(unfiltered) - set(high)) > 100
