"""One route table type for the router and the workers: 404 for a path, 405 for a method."""

from __future__ import annotations

import pytest

from pdtrio.protocol.openai import OpenAIError
from pdtrio.protocol.routes import RouteTable

TABLE = RouteTable({"/a": ("GET",), "/b": ("POST", "PUT")})


def test_a_known_path_asked_with_one_of_its_methods_passes() -> None:
    TABLE.check("GET", "/a")
    TABLE.check("PUT", "/b")
    assert "/a" in TABLE and "/c" not in TABLE


def test_an_unknown_path_is_a_404_that_names_it() -> None:
    with pytest.raises(OpenAIError) as raised:
        TABLE.check("GET", "/c")
    assert raised.value.status == 404
    assert raised.value.code == "not_found"
    assert "GET /c" in raised.value.message


def test_a_wrong_method_is_a_405_whose_allow_lists_every_method_of_the_path() -> None:
    with pytest.raises(OpenAIError) as raised:
        TABLE.check("GET", "/b")
    assert raised.value.status == 405
    assert raised.value.code == "method_not_allowed"
    assert dict(raised.value.headers)["allow"] == "POST, PUT"
