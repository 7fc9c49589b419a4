"""The official openai client, and plain HTTP, against the OpenAI-compatible endpoints,
both on the gateway directly and through Envoy."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import openai
import pytest


@pytest.fixture(scope="module", params=["gateway", "envoy"])
def base_url(request, services_stack):
    if request.param == "envoy":
        return f"http://{request.getfixturevalue('envoy_address')}/v1"
    return f"http://{services_stack.openai_address}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def ask(client, model, content, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)


def test_stream_and_unary_agree_and_report_usage(client, model_name):
    unary = ask(client, model_name, "the lazy dog", max_tokens=12, temperature=0)
    stream = ask(client, model_name, "the lazy dog", max_tokens=12, temperature=0, stream=True,
                 stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + unary.usage.completion_tokens


def test_content_parts_max_completion_tokens_and_cached_tokens(client, model_name):
    parts = [{"type": "text", "text": "the quick brown fox "}, {"type": "text", "text": "jumps over the dog " * 6}]
    first = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": parts}],
                                           max_completion_tokens=3)
    second = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": parts}],
                                            max_completion_tokens=3)
    assert first.usage.completion_tokens <= 3
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_seed_reproduces_sampled_output(client, model_name):
    replies = [ask(client, model_name, "fox", max_tokens=16, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
               for _ in range(2)]
    assert replies[0] == replies[1]


@pytest.mark.parametrize(
    "kwargs, error, status",
    [
        (dict(model="nope"), openai.NotFoundError, 404),
        (dict(messages=[]), openai.BadRequestError, 400),
        (dict(max_tokens=0), openai.BadRequestError, 400),
        (dict(max_tokens=100000), openai.BadRequestError, 400),
    ],
)
def test_errors_use_openai_shape_and_status(client, model_name, kwargs, error, status):
    args = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(error) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == status
    assert err.value.body["message"]


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    conn.request("POST", parsed.path + "/chat/completions", body=body,
                 headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"messages": "hi"}', 400, "messages"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 1}', 400, "frequency_penalty"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "no_such_option": 1}', 400, "no_such_option"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        (b'{"messages": [{"role": "user", "content": "' + b"a" * (20 << 20) + b'"}]}', 413, "over the limit"),
    ],
)
def test_malformed_bodies_get_4xx_and_the_next_request_succeeds(base_url, client, model_name, body, status, message):
    got_status, got = post(base_url, body)
    assert got_status == status
    assert message in got["error"]["message"]
    assert ask(client, model_name, "hi", max_tokens=2).usage.completion_tokens >= 1


def test_json_follows_openai_conventions(base_url, model_name):
    status, body = post(base_url, json.dumps({"model": model_name, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 200
    assert isinstance(body["created"], int)
    assert body["choices"][0]["index"] == 0 and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
