"""The challenge and response routers and workers prove the shared secret with (pure)."""

from __future__ import annotations

import pytest

from pdtrio.security import (
    MAX_OPEN_CHALLENGES,
    ChallengeBook,
    PeerAuthenticationError,
    PeerCredentials,
    answer_challenge,
    new_nonce,
    opening_authorization,
    parse_auth_params,
)

SECRET = "s3cret"


def _worker(identity: str = "decode-0") -> tuple[PeerCredentials, ChallengeBook]:
    credentials = PeerCredentials(SECRET)
    credentials.identity = identity
    return credentials, ChallengeBook(credentials, ttl_s=30.0)


def _exchange(book: ChallengeBook, now: float, router: PeerCredentials) -> str:
    client_nonce = new_nonce()
    challenge = book.challenge(opening_authorization(client_nonce), now, new_nonce())
    return answer_challenge(router, challenge, client_nonce, "decode-0")


def test_an_answer_is_admitted_once_and_only_before_it_expires() -> None:
    _, book = _worker()
    router = PeerCredentials(SECRET)
    answer = _exchange(book, 0.0, router)
    assert book.admits(answer, 1.0)
    assert not book.admits(answer, 1.0)  # used
    late = _exchange(book, 0.0, router)
    assert not book.admits(late, 31.0)
    assert len(book) == 0


def test_a_challenge_without_our_nonce_proves_nothing_and_opens_nothing() -> None:
    _, book = _worker()
    challenge = book.challenge(None, 0.0, new_nonce())
    params = parse_auth_params(challenge)
    assert params is not None and "proof" not in params
    assert len(book) == 0
    with pytest.raises(PeerAuthenticationError):
        answer_challenge(PeerCredentials(SECRET), challenge, new_nonce(), None)


def test_proofs_are_bound_to_the_instance_and_the_secret() -> None:
    _, book = _worker("decode-0")
    client_nonce = new_nonce()
    challenge = book.challenge(opening_authorization(client_nonce), 0.0, new_nonce())
    with pytest.raises(PeerAuthenticationError, match="not 'decode-1'"):
        answer_challenge(PeerCredentials(SECRET), challenge, client_nonce, "decode-1")
    with pytest.raises(PeerAuthenticationError, match="proof is wrong"):
        answer_challenge(PeerCredentials("other"), challenge, client_nonce, "decode-0")
    # a worker's proof answers our nonce, no other
    with pytest.raises(PeerAuthenticationError, match="another nonce"):
        answer_challenge(PeerCredentials(SECRET), challenge, new_nonce(), "decode-0")


def test_a_flood_of_challenges_is_bounded() -> None:
    _, book = _worker()
    router = PeerCredentials(SECRET)
    first = _exchange(book, 0.0, router)
    for _ in range(MAX_OPEN_CHALLENGES):
        book.challenge(opening_authorization(new_nonce()), 0.0, new_nonce())
    assert len(book) == MAX_OPEN_CHALLENGES
    assert not book.admits(first, 0.0)  # the oldest went first
    assert book.admits(_exchange(book, 0.0, router), 0.0)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer s3cret",
        "PDTRIO-HMAC",
        "PDTRIO-HMAC nonce",
        'PDTRIO-HMAC nonce="%%"',
        "x" * 9000,
    ],
)
def test_malformed_answers_are_refused(header: str | None) -> None:
    _, book = _worker()
    assert not book.admits(header, 0.0)


def test_without_a_secret_everyone_is_admitted() -> None:
    book = ChallengeBook(PeerCredentials(""))
    assert book.admits(None, 0.0)
