"""The one table from failure reasons to what the client sees: status, type, code."""

from __future__ import annotations

import pytest

from pdtrio.protocol import openai
from pdtrio.protocol.errors import ERRORS, Reason, status_for_worker_failure


def test_every_reason_has_its_answer() -> None:
    assert set(ERRORS) == set(Reason)
    for kind in ERRORS.values():
        assert 400 <= kind.status < 600
        server = kind.status >= 500 or kind.code == "queue_full"
        assert (kind.type == "server_error") == server, kind


# what clients have always seen: the table must not change any of it
@pytest.mark.parametrize(
    ("error", "status", "type_", "code", "headers"),
    [
        (
            openai.bad_request("x", code="invalid_json"),
            400,
            "invalid_request_error",
            "invalid_json",
            (),
        ),
        (openai.not_found("x"), 404, "invalid_request_error", "not_found", ()),
        (openai.not_found_model("m"), 404, "invalid_request_error", "model_not_found", ()),
        (
            openai.method_not_allowed("GET", "/v1/completions", ["POST"]),
            405,
            "invalid_request_error",
            "method_not_allowed",
            (("allow", "POST"),),
        ),
        (openai.body_timeout(1.0), 408, "invalid_request_error", "request_timeout", ()),
        (openai.request_too_large(10), 413, "invalid_request_error", "request_too_large", ()),
        (
            openai.unsupported_media_type(None),
            415,
            "invalid_request_error",
            "unsupported_media_type",
            (),
        ),
        (
            openai.unauthorized(True),
            401,
            "invalid_request_error",
            "invalid_api_key",
            (("www-authenticate", "Bearer"),),
        ),
        (
            openai.too_many_requests("x"),
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
            (("retry-after", "1"),),
        ),
        (openai.queue_full(), 429, "server_error", "queue_full", (("retry-after", "1"),)),
        (openai.server_error("x"), 500, "server_error", None, ()),
        (openai.service_unavailable("x"), 503, "server_error", "service_unavailable", ()),
        (openai.gateway_timeout("x"), 504, "server_error", "timeout", ()),
        (
            openai.context_length_exceeded(prompt_tokens=5, max_tokens=None, context_length=4),
            400,
            "invalid_request_error",
            "context_length_exceeded",
            (),
        ),
    ],
)
def test_the_named_errors_answer_as_before(
    error: openai.OpenAIError,
    status: int,
    type_: str,
    code: str | None,
    headers: tuple[tuple[str, str], ...],
) -> None:
    assert (error.status, error.type, error.code, error.headers) == (status, type_, code, headers)


def test_a_reason_with_a_code_keeps_it_and_extra_headers_add_up() -> None:
    error = openai.error_for(
        Reason.QUEUE_FULL, "full", code="ignored", headers=(("x-pdtrio-router", "1"),)
    )
    assert error.code == "queue_full"
    assert error.headers == (("retry-after", "1"), ("x-pdtrio-router", "1"))
    assert error.to_body() == {
        "error": {"message": "full", "type": "server_error", "param": None, "code": "queue_full"}
    }


@pytest.mark.parametrize(
    ("worker", "client"), [(400, 400), (409, 409), (500, 502), (503, 503), (504, 502)]
)
def test_a_workers_failure_is_a_bad_gateway_but_busy_and_refusals_pass(
    worker: int, client: int
) -> None:
    assert status_for_worker_failure(worker) == client
