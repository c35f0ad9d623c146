"""Calling a worker as its router: the HTTP challenge and response of ``pdtrio.security``.

A call to a worker endpoint goes out with a fresh nonce of ours; the worker answers
401 with a challenge that proves it holds the secret (an HMAC over our nonce, its own
and its instance id); only then is the call repeated, carrying our proof over both
nonces.  What travels is worthless to anyone else: each proof answers nonces that are
used once.  Without a secret on our side, calls go out plain.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import final

import httpx

from pdtrio.security import (
    PeerAuthenticationError,
    PeerCredentials,
    answer_challenge,
    new_nonce,
    opening_authorization,
)

__all__ = ["PeerAuthenticationError", "WorkerAuth", "link_authorization"]

# where a router asks for a challenge before opening a link (any path would do)
AUTH_PATH = "/pd/auth"


@final
class WorkerAuth(httpx.Auth):
    """httpx's auth flow for one worker call: nonce, challenge, answer.

    ``expected_instance``: the instance id the worker must prove it is (None: any, as for
    a statically listed URL whose id is learnt from the answer).  A worker that lets the
    call through without proving itself is refused when we hold a secret: it would be
    anyone's listener.
    """

    # the challenge's body (a small JSON error) is read, so its connection can be reused
    requires_response_body = True

    def __init__(self, credentials: PeerCredentials, expected_instance: str | None = None) -> None:
        self._credentials = credentials
        self._expected_instance = expected_instance

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if not self._credentials.required:
            yield request
            return
        client_nonce = new_nonce()
        request.headers["authorization"] = opening_authorization(client_nonce)
        response = yield request
        request.headers["authorization"] = _answer(
            response, self._credentials, client_nonce, self._expected_instance
        )
        yield request


async def link_authorization(
    http: httpx.AsyncClient,
    base_url: str,
    credentials: PeerCredentials,
    expected_instance: str | None,
) -> list[tuple[bytes, bytes]]:
    """The headers of a link's websocket handshake: a challenge asked for over ``http``
    and answered (nothing when we hold no secret).  Raises PeerAuthenticationError, or
    httpx's errors when the worker cannot be reached."""
    if not credentials.required:
        return []
    client_nonce = new_nonce()
    response = await http.get(
        base_url + AUTH_PATH, headers={"authorization": opening_authorization(client_nonce)}
    )
    answer = _answer(response, credentials, client_nonce, expected_instance)
    return [(b"authorization", answer.encode())]


def _answer(
    response: httpx.Response,
    credentials: PeerCredentials,
    client_nonce: bytes,
    expected_instance: str | None,
) -> str:
    """Our answer to the challenge ``response`` carries, once it proved the worker holds
    the secret; PeerAuthenticationError for any other response."""
    if response.status_code != 401:
        raise PeerAuthenticationError(
            f"{response.request.url}: answered {response.status_code} without proving it holds "
            "the worker secret (a worker started without one, or not a pdtrio worker)"
        )
    return answer_challenge(
        credentials, response.headers.get("www-authenticate"), client_nonce, expected_instance
    )
