from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.scheduling import Candidate, pick_instance


def test_least_loaded_wins() -> None:
    candidates = [Candidate("a", 3), Candidate("b", 1), Candidate("c", 2)]
    assert pick_instance(candidates, turn=0) == "b"


def test_ties_rotate_with_the_turn() -> None:
    candidates = [Candidate("a", 0), Candidate("b", 0)]
    assert {pick_instance(candidates, turn=t) for t in range(4)} == {"a", "b"}


def test_unhealthy_and_excluded_are_skipped() -> None:
    candidates = [Candidate("a", 0, healthy=False), Candidate("b", 5), Candidate("c", 9)]
    assert pick_instance(candidates, turn=0) == "b"
    assert pick_instance(candidates, turn=0, exclude=frozenset({"b"})) == "c"
    assert pick_instance(candidates, turn=0, exclude=frozenset({"b", "c"})) is None


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=8), st.integers(0, 100))
def test_the_choice_is_always_a_healthy_least_loaded_one(
    raw: list[tuple[int, bool]], turn: int
) -> None:
    candidates = [Candidate(str(i), load, healthy) for i, (load, healthy) in enumerate(raw)]
    chosen = pick_instance(candidates, turn=turn)
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        assert chosen is None
    else:
        picked = next(c for c in candidates if c.instance_id == chosen)
        assert picked.healthy and picked.active_requests == min(c.active_requests for c in healthy)
