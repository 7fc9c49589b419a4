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
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kw
    )


def test_stream_and_unary_agree_and_report_usage(client, model_name):
    unary = ask(client, model_name, "the lazy dog", max_tokens=12, temperature=0)
    stream = ask(
        client,
        model_name,
        "the lazy dog",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + unary.usage.completion_tokens


def test_content_parts_max_completion_tokens_and_cached_tokens(client, model_name):
    parts = [
        {"type": "text", "text": "the quick brown fox "},
        {"type": "text", "text": "jumps over the dog " * 6},
    ]
    first = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": parts}], max_completion_tokens=3
    )
    second = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": parts}], max_completion_tokens=3
    )
    assert first.usage.completion_tokens <= 3
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        == (second.usage.prompt_tokens - 1) // 16 * 16
        > 0
    )


def test_seed_reproduces_sampled_output(client, model_name):
    replies = [
        ask(client, model_name, "fox", max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
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
    args = {
        "model": model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **kwargs,
    }
    with pytest.raises(error) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == status
    assert err.value.body["message"]


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    conn.request(
        "POST",
        parsed.path + "/chat/completions",
        body=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"messages": "hi"}', 400, "messages"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}',
            400,
            "max_tokens",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 1}',
            400,
            "frequency_penalty",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "no_such_option": 1}',
            400,
            "no_such_option",
        ),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        (
            b'{"messages": [{"role": "user", "content": "' + b"a" * (20 << 20) + b'"}]}',
            413,
            "over the limit",
        ),
    ],
)
def test_malformed_bodies_get_4xx_and_the_next_request_succeeds(
    base_url, client, model_name, body, status, message
):
    got_status, got = post(base_url, body)
    assert got_status == status
    assert message in got["error"]["message"]
    assert ask(client, model_name, "hi", max_tokens=2).usage.completion_tokens >= 1


def test_json_follows_openai_conventions(base_url, model_name):
    status, body = post(
        base_url,
        json.dumps(
            {"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        ).encode(),
    )
    assert status == 200
    assert isinstance(body["created"], int)
    assert body["choices"][0]["index"] == 0 and body["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_completion_prompts_as_token_ids_and_lists_give_one_choice_per_prompt_and_n(
    client, model_name
):
    text = client.completions.create(
        model=model_name, prompt="the quick brown fox", max_tokens=6, temperature=0
    )
    tokenized = client.completions.create(
        model=model_name, prompt=[[1, 2, 3, 4]], max_tokens=6, temperature=0
    )
    assert tokenized.usage.prompt_tokens == 4
    texts = client.completions.create(
        model=model_name,
        prompt=["the quick brown fox", "the quick brown fox"],
        max_tokens=6,
        temperature=0,
    )
    assert [c.text for c in texts.choices] == [text.choices[0].text] * 2
    batch = client.completions.create(
        model=model_name, prompt=[[5, 6, 7], [1, 2, 3, 4]], max_tokens=6, temperature=0, n=2
    )
    single = client.completions.create(
        model=model_name, prompt=[5, 6, 7], max_tokens=6, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # Greedy: both choices of a prompt equal the prompt's own single completion.
    assert [c.text for c in batch.choices] == [single.choices[0].text] * 2 + [
        tokenized.choices[0].text
    ] * 2
    assert batch.usage.prompt_tokens == 3 + 4  # each prompt counted once
    assert batch.usage.completion_tokens == 2 * (
        single.usage.completion_tokens + tokenized.usage.completion_tokens
    )


def test_chat_n_samples_distinct_choices_streamed_and_unary(client, model_name):
    unary = ask(client, model_name, "the fox", max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [c.index for c in unary.choices] == [0, 1, 2]
    assert len({c.message.content for c in unary.choices}) > 1  # seeded per choice, not copies
    chunks = list(
        ask(
            client,
            model_name,
            "the fox",
            max_tokens=8,
            temperature=1.0,
            seed=3,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = [
        "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        for i in range(3)
    ]
    assert streamed == [c.message.content for c in unary.choices]
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens


def test_chat_logprobs_and_top_logprobs(client, model_name):
    reply = ask(
        client, model_name, "the dog", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(reply.choices[0].message.content)
    for token in content:
        assert len(token.top_logprobs) == 3
        assert (
            token.top_logprobs[0].logprob
            >= token.top_logprobs[1].logprob
            >= token.top_logprobs[2].logprob
        )
        # greedy: the chosen token is the likeliest
        assert token.top_logprobs[0].token == token.token
        assert token.logprob == token.top_logprobs[0].logprob <= 0
        assert bytes(token.bytes).decode() == token.token
    streamed = [
        t
        for c in ask(
            client, model_name, "the dog", max_tokens=5, temperature=0, logprobs=True, stream=True
        )
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_completion_logprobs_in_the_legacy_shape(client, model_name):
    reply = client.completions.create(
        model=model_name, prompt="the lazy", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(
        len(top) <= 2 and max(top.values()) == lp
        for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens).startswith(
        reply.choices[0].text
    )


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"extra_body": {"best_of": 3}}, "best_of"),
        ({"extra_body": {"no_such_parameter": True}}, "no_such_parameter"),
    ],
)
def test_unsupported_parameters_get_a_400_naming_them(client, model_name, extra, named):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, model_name, "hi", max_tokens=2, **extra)
    assert named in err.value.body["message"]


def test_neutral_values_of_unsupported_parameters_are_accepted(client, model_name):
    reply = ask(
        client,
        model_name,
        "hi",
        max_tokens=2,
        presence_penalty=0,
        frequency_penalty=0,
        user="someone",
        extra_body={"repetition_penalty": 1.0},
    )
    assert reply.usage.completion_tokens >= 1
