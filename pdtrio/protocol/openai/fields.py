"""The OpenAI request fields every endpoint reads alike: the JSON object, the optional
scalars, and the sampling parameters (``_sampling``) with their checks."""

from __future__ import annotations

import json
import math
from typing import Any, Final

import msgspec

from pdtrio.protocol.link.wire import (
    MAX_TOP_LOGPROBS,
)
from pdtrio.protocol.openai.errors import (
    OpenAIError,
    bad_request,
    invalid_type,
    json_type_name,
    show_client_text,
)
from pdtrio.protocol.openai.json_pieces import PIECEWISE_JSON_BYTES, load_piecewise
from pdtrio.protocol.openai.structured import structured_output
from pdtrio.protocol.sampling import MAX_CHOICES, SamplingParams

CHAT_ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})
_CHAT_PART_TYPES: Final = frozenset({"text"})
MAX_STOP_SEQUENCES: Final = 4
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_JUST_INT: Final = frozenset({int})
# top_k larger than any vocabulary is "off" in effect; the bound keeps it packable.
_TOP_K_MAX: Final = 2**31 - 1
# token ids in logit_bias and stop_token_ids: more than any sampler step should walk
MAX_LOGIT_BIAS: Final = 1024
MAX_STOP_TOKEN_IDS: Final = 1024
_BIAS_LIMIT: Final = 100.0  # OpenAI's: a bias is between -100 and 100
_PENALTY_LIMIT: Final = 2.0  # presence and frequency penalties: between -2 and 2 (OpenAI's)


# --- validation helpers ----------------------------------------------------------


# (kept under their old names: the helpers below use them throughout)
_json_type = json_type_name
_type_error = invalid_type


def _missing(param: str) -> OpenAIError:
    return bad_request(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _load_object(
    body: bytes | bytearray, count_past: tuple[str, int] | None = None
) -> dict[str, Any]:
    try:
        if len(body) > PIECEWISE_JSON_BYTES:
            obj = load_piecewise(body, count_past)
        else:
            obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, bad UTF-8 and over-long integers.
        raise bad_request(
            f"The request body is not valid JSON: {exc}"[:200], code="invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise bad_request(
            f"The request body must be a JSON object, but got {_json_type(obj)}.",
            code="invalid_json",
        )
    return obj


# Characters of a string encoded per C call when checking it for lone surrogates.
_CHECK_CHUNK_CHARS: Final = 1024 * 1024


def _check_text(value: str, param: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); they cannot be tokenized or packed.
    try:
        # a piece at a time: a megabyte is a fraction of a millisecond (a str holds code
        # points, so no cut splits a pair)
        for start in range(0, len(value), _CHECK_CHUNK_CHARS):
            value[start : start + _CHECK_CHUNK_CHARS].encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"Invalid value for '{param}': the string contains an unpaired surrogate.",
            param=param,
        ) from None
    return value


def _opt_str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(key, "a string", value)
    return _check_text(value, key)


def _opt_bool(obj: dict[str, Any], key: str, param: str | None = None) -> bool | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _type_error(param or key, "a boolean", value)
    return value


def _opt_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, "an integer", value)
    return value


def _opt_number(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(key, "a number", value)
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"Invalid value for '{key}': must be a finite number.", param=key)
    return number


def _reject_truthy_flag(obj: dict[str, Any], key: str, message: str) -> None:
    if _opt_bool(obj, key):
        raise bad_request(message, param=key)


def _choices(obj: dict[str, Any], sampling: SamplingParams) -> SamplingParams:
    """``sampling`` with the request's ``n`` (how many choices; 1 to MAX_CHOICES)."""
    n = _opt_int(obj, "n")
    if n is None or n == 1:
        return sampling
    if n < 1:
        raise bad_request(f"Invalid value for 'n': {n} is less than 1.", param="n")
    if n > MAX_CHOICES:
        raise bad_request(
            f"Invalid value for 'n': {n} is greater than the maximum of {MAX_CHOICES}.",
            param="n",
        )
    return msgspec.structs.replace(sampling, n=n)


def _top_logprobs_count(value: int, param: str) -> int:
    if value < 0:
        raise bad_request(f"Invalid value for '{param}': {value} is less than 0.", param=param)
    if value > MAX_TOP_LOGPROBS:
        raise bad_request(
            f"Invalid value for '{param}': {value} is greater than the maximum of "
            f"{MAX_TOP_LOGPROBS}.",
            param=param,
        )
    return value


def _chat_logprobs(obj: dict[str, Any]) -> int:
    """Chat's ``logprobs`` (a flag) and ``top_logprobs`` (0..20, only with it), as
    ``SamplingParams.logprobs``: -1 when not asked."""
    asked = _opt_bool(obj, "logprobs")
    top = _opt_int(obj, "top_logprobs")
    if top is not None:
        _top_logprobs_count(top, "top_logprobs")
        if top > 0 and not asked:
            # vLLM's rule (and OpenAI's): alternatives come only with the token's own
            raise bad_request(
                "When using 'top_logprobs', 'logprobs' must be set to true.",
                param="top_logprobs",
            )
    if not asked:
        return -1
    return top or 0


def _completion_logprobs(obj: dict[str, Any]) -> int:
    """Completions' ``logprobs``: a count of alternatives, 0..20 (OpenAI's limit is 5;
    vLLM's default max_logprobs, 20, is served), -1 when not asked."""
    value = obj.get("logprobs")
    if value is None or value is False:  # (false: what some clients send for "off")
        return -1
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error("logprobs", "an integer", value)
    return _top_logprobs_count(value, "logprobs")


def _token_limit(obj: dict[str, Any], key: str, max_tokens_limit: int) -> int | None:
    value = _opt_int(obj, key)
    if value is None:
        return None
    if value < 1:
        raise bad_request(f"Invalid value for '{key}': {value} is less than 1.", param=key)
    if value > max_tokens_limit:
        raise bad_request(
            f"Invalid value for '{key}': {value} is greater than the maximum of {max_tokens_limit}.",
            param=key,
        )
    return value


def _stop(obj: dict[str, Any]) -> tuple[str, ...]:
    raw = obj.get("stop")
    if raw is None:
        return ()
    if isinstance(raw, str):
        items: list[Any] = [raw]
        wheres = ["stop"]
    elif isinstance(raw, list):
        if len(raw) > MAX_STOP_SEQUENCES:
            raise bad_request(
                f"Invalid 'stop': at most {MAX_STOP_SEQUENCES} stop sequences are allowed.",
                param="stop",
            )
        items = raw
        wheres = [f"stop.[{i}]" for i in range(len(raw))]
    else:
        raise _type_error("stop", "a string or an array of strings", raw)
    for item, where in zip(items, wheres, strict=True):
        if not isinstance(item, str):
            raise _type_error(where, "a string", item)
        if not item:
            raise bad_request("Stop sequences must not be empty strings.", param="stop")
        _check_text(item, "stop")
    return tuple(items)


def _sampling(
    obj: dict[str, Any], max_tokens_limit: int, *, allow_completion_alias: bool, logprobs: int
) -> tuple[SamplingParams, int | None]:
    """The sampling parameters and the client's max_tokens (None: not set)."""
    max_tokens, min_tokens = _token_bounds(obj, max_tokens_limit, allow_completion_alias)
    temperature = _opt_number(obj, "temperature")
    if temperature is None:
        temperature = 1.0
    elif not 0.0 <= temperature <= 2.0:
        raise bad_request(
            f"Invalid value for 'temperature': {temperature} is not between 0 and 2.",
            param="temperature",
        )
    top_p = _opt_number(obj, "top_p")
    if top_p is None:
        top_p = 1.0
    elif not 0.0 < top_p <= 1.0:
        raise bad_request(
            f"Invalid value for 'top_p': {top_p} must be greater than 0 and at most 1.",
            param="top_p",
        )
    top_k = _opt_int(obj, "top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    elif not 0 <= top_k <= _TOP_K_MAX:
        raise bad_request(
            f"Invalid value for 'top_k': {top_k}; use -1 or 0 to disable, or a positive count.",
            param="top_k",
        )
    seed = _opt_int(obj, "seed")
    if seed is not None and not _INT64_MIN <= seed <= _INT64_MAX:
        raise bad_request(
            "Invalid value for 'seed': must fit in a signed 64-bit integer.", param="seed"
        )

    penalties = {key: _penalty(obj, key) for key in ("presence_penalty", "frequency_penalty")}
    repetition_penalty, min_p = _repetition_penalty_and_min_p(obj)

    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        min_tokens=min_tokens,
        stop=_stop(obj),
        ignore_eos=bool(_opt_bool(obj, "ignore_eos")),
        logit_bias=_logit_bias(obj),
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        repetition_penalty=repetition_penalty,
        min_p=min_p,
        stop_token_ids=_stop_token_ids(obj),
        logprobs=logprobs,
        structured=structured_output(obj),
    )
    return sampling, max_tokens


def _token_bounds(
    obj: dict[str, Any], max_tokens_limit: int, allow_completion_alias: bool
) -> tuple[int | None, int]:
    """The client's max_tokens (None: not set) and min_tokens, checked against each other."""
    max_tokens = _token_limit(obj, "max_tokens", max_tokens_limit)
    limit_param = "max_tokens"
    if allow_completion_alias:
        newer = _token_limit(obj, "max_completion_tokens", max_tokens_limit)
        if newer is not None:
            max_tokens, limit_param = newer, "max_completion_tokens"
    min_tokens = _opt_int(obj, "min_tokens") or 0
    if min_tokens < 0:
        raise bad_request(
            f"Invalid value for 'min_tokens': {min_tokens} is less than 0.", param="min_tokens"
        )
    upper = max_tokens if max_tokens is not None else max_tokens_limit
    if min_tokens > upper:
        raise bad_request(
            f"Invalid value for 'min_tokens': {min_tokens} is greater than "
            f"'{limit_param}' ({upper}).",
            param="min_tokens",
        )
    return max_tokens, min_tokens


def _repetition_penalty_and_min_p(obj: dict[str, Any]) -> tuple[float, float]:
    repetition_penalty = _opt_number(obj, "repetition_penalty")
    if repetition_penalty is None:
        repetition_penalty = 1.0
    elif not repetition_penalty > 0.0:  # vLLM's bound (OpenAI has no such field)
        raise bad_request(
            f"Invalid value for 'repetition_penalty': {repetition_penalty} must be greater than 0.",
            param="repetition_penalty",
        )
    min_p = _opt_number(obj, "min_p")
    if min_p is None:
        min_p = 0.0
    elif not 0.0 <= min_p <= 1.0:
        raise bad_request(
            f"Invalid value for 'min_p': {min_p} is not between 0 and 1.", param="min_p"
        )
    return repetition_penalty, min_p


def _penalty(obj: dict[str, Any], key: str) -> float:
    penalty = _opt_number(obj, key)
    if penalty is None:
        return 0.0
    if not -_PENALTY_LIMIT <= penalty <= _PENALTY_LIMIT:
        raise bad_request(
            f"Invalid value for '{key}': {penalty} is not between -2 and 2.", param=key
        )
    return penalty


def _logit_bias(obj: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs by id; whether each id is in the vocabulary is the engine's
    to say (it knows the vocabulary)."""
    raw = obj.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise _type_error("logit_bias", "an object", raw)
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"Invalid 'logit_bias': at most {MAX_LOGIT_BIAS} token ids are allowed.",
            param="logit_bias",
        )
    pairs: dict[int, float] = {}
    for key, value in raw.items():
        # keys are token ids written in decimal, as OpenAI's (JSON keys are strings)
        if not (key.isascii() and key.isdigit()) or int(key) > _INT64_MAX:
            raise bad_request(
                f"Invalid key in 'logit_bias': {show_client_text(key)} is not a token id.",
                param="logit_bias",
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _type_error(f"logit_bias.{key}", "a number", value)
        # OpenAI refuses a bias past 100 (vLLM clamps it): refused, naming the field
        if not -_BIAS_LIMIT <= value <= _BIAS_LIMIT:  # (json reads NaN and Infinity: refused)
            raise bad_request(
                f"Invalid value for 'logit_bias.{key}': {value} is not between -100 and 100.",
                param="logit_bias",
            )
        pairs[int(key)] = float(value)
    return tuple(sorted(pairs.items()))


def _stop_token_ids(obj: dict[str, Any]) -> tuple[int, ...]:
    raw = obj.get("stop_token_ids")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _type_error("stop_token_ids", "an array of token ids", raw)
    if len(raw) > MAX_STOP_TOKEN_IDS:
        raise bad_request(
            f"Invalid 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} token ids are allowed.",
            param="stop_token_ids",
        )
    for i, token in enumerate(raw):
        if isinstance(token, bool) or not isinstance(token, int):
            raise _type_error(f"stop_token_ids.[{i}]", "an integer token id", token)
        if not 0 <= token <= _INT64_MAX:
            raise bad_request(
                f"Invalid value for 'stop_token_ids.[{i}]': {token} is not a valid token id.",
                param="stop_token_ids",
            )
    return tuple(sorted(set(raw)))


def _streaming(obj: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = bool(_opt_bool(obj, "stream"))
    options = obj.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include_usage = bool(_opt_bool(options, "include_usage", "stream_options.include_usage"))
    continuous = bool(
        _opt_bool(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    )
    return stream, include_usage, include_usage and continuous
