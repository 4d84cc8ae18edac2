"""--api-key protects every route except /health, in each protocol's 401 shape."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import FAKE, run_server
from server_helpers import MESSAGES, assert_anthropic_error, assert_openai_error

KEY = "sekret-key"
SERVER_ARGS = ("--api-key", KEY)

OPENAI_ROUTES = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                 ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"),
                 ("POST", "/sleep"), ("POST", "/wakeup"), ("GET", "/is_sleeping"), ("POST", "/abort"),
                 ("GET", "/openapi.json")]
ANTHROPIC_ROUTES = [("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")]


@pytest.mark.parametrize(("method", "path"), OPENAI_ROUTES)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_openai_routes_need_the_key(server, method: str, path: str, headers: dict):
    response = httpx.request(method, server.url(path), headers=headers, json={})
    assert_openai_error(response, 401)
    assert response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("method", "path"), ANTHROPIC_ROUTES)
def test_anthropic_routes_need_the_key(server, method: str, path: str):
    response = httpx.request(method, server.url(path), headers={"x-api-key": "wrong"}, json={})
    assert assert_anthropic_error(response, 401)["type"] == "authentication_error"


def test_health_is_open(server):
    assert httpx.get(server.url("/health")).status_code == 200


def test_bearer_and_x_api_key_both_work(server):
    body = {"max_tokens": 3, "messages": MESSAGES}
    assert httpx.post(server.url("/v1/messages"), json=body, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.post(server.url("/v1/messages"), json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(server.url("/metrics"), headers={"x-api-key": KEY}).status_code == 200


def test_openai_client_with_and_without_the_key(server, client: openai.OpenAI, model: str):
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).choices
    with openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_key_from_the_environment():
    with run_server(FAKE, env={"CORE_API_KEY": "from-env"}) as server:
        assert_openai_error(httpx.get(server.url("/v1/models")), 401)
        assert httpx.get(server.url("/v1/models"), headers={"Authorization": "Bearer from-env"}).status_code == 200
