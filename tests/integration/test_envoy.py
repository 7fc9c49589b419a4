"""Through Envoy: gRPC passed through, and REST/JSON transcoded from the same protos."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from tandem.v1 import inference_pb2, inference_pb2_grpc

CHAT = {
    "messages": [{"role": "user", "content": "the quick fox"}],
    "max_tokens": 8,
    "temperature": 0,
}


def request(address: str, method: str, path: str, body: dict | None = None):
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        method,
        path,
        body=json.dumps(body) if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    return response.status, response.getheader("Content-Type"), response.read().decode()


def test_grpc_through_envoy_equals_grpc_to_the_gateway(services_stack, envoy_address):
    from google.protobuf import json_format

    message = json_format.ParseDict(CHAT, inference_pb2.ChatCompletionRequest())
    direct = inference_pb2_grpc.InferenceStub(services_stack.gateway_channel).CreateChatCompletion(
        message, timeout=30
    )
    with grpc.insecure_channel(envoy_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        via_envoy = stub.CreateChatCompletion(message, timeout=30)
        chunks = list(stub.StreamChatCompletion(message, timeout=30))
    assert via_envoy.choices[0].message.content == direct.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content for c in chunks if c.choices)
    assert streamed == direct.choices[0].message.content.string_value


def test_rest_json_is_transcoded_unary_and_as_server_sent_events(envoy_address):
    status, _, body = request(envoy_address, "POST", "/tandem/v1/chat/completions", CHAT)
    assert status == 200
    unary = json.loads(body)
    assert unary["object"] == "chat.completion" and unary["usage"]["prompt_tokens"] > 0

    status, content_type, body = request(
        envoy_address, "POST", "/tandem/v1/chat/completions:stream", CHAT
    )
    assert status == 200
    events = [
        json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")
    ]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    assert text == unary["choices"][0]["message"]["content"]

    status, _, body = request(envoy_address, "GET", "/tandem/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["object"] == "model"


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": "missing", **CHAT}, 404),
        ({**CHAT, "max_tokens": 0}, 400),
        ({"messages": []}, 400),
    ],
)
def test_rest_errors_map_to_http_statuses(envoy_address, body, status):
    got, _, text = request(envoy_address, "POST", "/tandem/v1/chat/completions", body)
    assert got == status, text


def test_rest_bodies_and_replies_larger_than_envoys_connection_buffer_pass_the_transcoder(
    envoy_address,
):
    """Envoy buffers 32 KiB per connection, but the transcoder reads a REST body and a unary
    reply whole: both may be larger (bodies up to the gateway's own 8 MiB limit)."""
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "the quick fox " * 4000}]}
    status, _, body = request(envoy_address, "POST", "/tandem/v1/chat/completions", long_prompt)
    # the gateway's own answer (the prompt is longer than the model's context), not Envoy's 413
    assert status == 400 and "envoy" not in body, body
    many_logprobs = {**CHAT, "max_tokens": 64, "logprobs": True, "top_logprobs": 20}
    status, _, body = request(envoy_address, "POST", "/tandem/v1/chat/completions", many_logprobs)
    assert status == 200 and len(body) > 32768
    assert len(json.loads(body)["choices"][0]["logprobs"]["content"]) == 64
