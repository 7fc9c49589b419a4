"""API keys through the whole stack (gateway with --api-keys-file, behind Envoy): 401 without
a key and with a wrong one over OpenAI HTTP, REST and gRPC; 429 with Retry-After past a key's
request limit and past its token limit; usage counted per key name in metrics; Health shows
workers only to a key holder; no key in any process's log; and TLS ended at Envoy (docs/operations.md's
example), HTTPS and gRPC over TLS with a key."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from deploy.envoy.render import render, start_envoy
from deploy.processes import free_port, stop
from deploy.stack import start_stack
from services.gateway.api_keys import add_key
from tandem.v1 import inference_pb2, inference_pb2_grpc


@pytest.fixture(scope="module")
def keyed(chat_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    path = str(folder / "keys.json")
    keys = {
        "open": add_key(path, "open"),
        "rpm": add_key(path, "rpm", requests_per_minute=2),
        "tpm": add_key(path, "tpm", tokens_per_minute=40),
    }
    log_path = folder / "stack.log"
    with open(log_path, "w") as log:
        stack = start_stack(
            str(chat_checkpoint),
            worker_args=("--kv-cache-bytes", str(8 << 20)),
            gateway_args=("--api-keys-file", path, "--prices", "input:1,cached_input:0.5,output:2"),
            stderr=log,
        )
    yield stack, keys, log_path
    stack.stop()


def post(address: str, path: str, body: dict, key: str | None) -> tuple[int, object, dict]:
    headers = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {key}"} if key else {}),
    }
    request = urllib.request.Request(
        f"http://{address}{path}", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read() or b"{}")


CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_http_and_rest_refuse_a_missing_or_wrong_key_with_401(keyed):
    stack, keys, _ = keyed
    for path in ("/v1/chat/completions", "/tandem/v1/chat/completions"):
        for key in (None, "tandem-not-a-key"):
            status, _, body = post(stack.envoy_address, path, CHAT, key)
            assert status == 401, (path, key, body)
        status, _, body = post(stack.envoy_address, path, CHAT, keys["open"])
        assert status == 200 and body["choices"], path
    status, _, body = post(stack.envoy_address, "/v1/chat/completions", CHAT, None)
    assert (
        body["error"]["code"] == "invalid_api_key"
        and body["error"]["type"] == "invalid_request_error"
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"http://{stack.envoy_address}/v1", api_key="tandem-wrong", max_retries=0
        ).models.list()
    client = openai.OpenAI(
        base_url=f"http://{stack.envoy_address}/v1", api_key=keys["open"], max_retries=0
    )
    assert client.chat.completions.create(
        model=client.models.list().data[0].id,
        max_tokens=4,
        messages=[{"role": "user", "content": "hi"}],
    ).choices


def test_responses_and_messages_take_the_same_keys(keyed):
    """Responses with a Bearer key; Messages with x-api-key (Anthropic's header) or Bearer, and
    401 in each API's own shape without one."""
    stack, keys, _ = keyed
    status, _, body = post(
        stack.envoy_address, "/v1/responses", {"input": "hello", "max_output_tokens": 4}, None
    )
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (
        post(
            stack.envoy_address,
            "/v1/responses",
            {"input": "hello", "max_output_tokens": 4},
            keys["open"],
        )[0]
        == 200
    )
    model = (
        openai.OpenAI(base_url=f"http://{stack.envoy_address}/v1", api_key=keys["open"])
        .models.list()
        .data[0]
        .id
    )
    message = {
        "model": model,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}],
    }
    status, _, body = post(stack.envoy_address, "/v1/messages", message, None)
    assert (
        status == 401
        and body["error"]["type"] == "authentication_error"
        and body["type"] == "error"
    )
    assert post(stack.envoy_address, "/v1/messages", message, keys["open"])[0] == 200
    for key in (keys["open"], "tandem-not-a-key"):
        request = urllib.request.Request(
            f"http://{stack.envoy_address}/v1/messages",
            data=json.dumps(message).encode(),
            headers={"Content-Type": "application/json", "x-api-key": key},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                assert key == keys["open"] and json.load(response)["content"]
        except urllib.error.HTTPError as exc:
            assert key != keys["open"] and exc.code == 401


def test_grpc_refuses_a_missing_or_wrong_key_and_health_shows_workers_only_to_a_key_holder(keyed):
    stack, keys, _ = keyed
    request = inference_pb2.ChatCompletionRequest(max_tokens=4)
    request.messages.add(role="user").content.string_value = "hello"
    with grpc.insecure_channel(stack.envoy_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for metadata in ((), (("authorization", "Bearer tandem-not-a-key"),)):
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateChatCompletion(request, timeout=30, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError):
                list(stub.StreamChatCompletion(request, timeout=30, metadata=metadata))
        good = (("authorization", f"Bearer {keys['open']}"),)
        assert stub.CreateChatCompletion(request, timeout=30, metadata=good).choices
        anonymous = stub.Health(inference_pb2.HealthCheckRequest(), timeout=10)
        holder = stub.Health(inference_pb2.HealthCheckRequest(), timeout=10, metadata=good)
    assert anonymous.ready and anonymous.num_workers == 1 and not anonymous.workers
    assert [w.address for w in holder.workers] == stack.worker_addresses


def test_past_a_request_limit_and_a_token_limit_a_caller_gets_429_with_retry_after(keyed):
    stack, keys, _ = keyed
    statuses = [
        post(stack.envoy_address, "/v1/chat/completions", CHAT, keys["rpm"])[0] for _ in range(2)
    ]
    status, headers, body = post(stack.envoy_address, "/v1/chat/completions", CHAT, keys["rpm"])
    assert statuses == [200, 200] and status == 429, body
    assert (
        1 <= int(headers["Retry-After"]) <= 60
        and "2 requests per minute" in body["error"]["message"]
    )
    big = {
        **CHAT,
        "max_tokens": 30,
        "messages": [{"role": "user", "content": "tell me a long story " * 4}],
    }
    # well past 40 tokens
    assert post(stack.envoy_address, "/v1/chat/completions", big, keys["tpm"])[0] == 200
    status, headers, body = post(stack.envoy_address, "/v1/chat/completions", CHAT, keys["tpm"])
    assert (
        status == 429
        and int(headers["Retry-After"]) >= 1
        and "tokens per minute" in body["error"]["message"]
    )
    # others unaffected
    assert post(stack.envoy_address, "/v1/chat/completions", CHAT, keys["open"])[0] == 200


def test_usage_is_counted_per_key_name_in_metrics(keyed):
    stack, keys, _ = keyed
    _, _, body = post(stack.envoy_address, "/v1/chat/completions", CHAT, keys["open"])
    with urllib.request.urlopen(f"http://{stack.openai_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem:api_key_")
    }
    assert samples['tandem:api_key_requests_total{key="open"}'] >= 1
    assert (
        samples['tandem:api_key_tokens_total{key="open",kind="prompt"}']
        >= body["usage"]["prompt_tokens"]
    )
    assert (
        samples['tandem:api_key_tokens_total{key="open",kind="completion"}']
        >= body["usage"]["completion_tokens"]
    )
    assert samples['tandem:api_key_cost_usd_total{key="open"}'] > 0
    assert samples['tandem:api_key_rejected_total{key="",reason="wrong_key"}'] >= 1
    assert samples['tandem:api_key_rejected_total{key="rpm",reason="requests"}'] >= 1
    assert not any(key in text for key in keys.values())


def test_no_key_reaches_any_log(keyed):
    stack, keys, log_path = keyed
    post(stack.envoy_address, "/v1/chat/completions", CHAT, keys["open"])
    log = log_path.read_text()
    # the gateway's log is here, and names its keys by name
    assert "API keys: 3 (open, rpm, tpm)" in log
    assert not any(key in log for key in keys.values())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_tls_ends_at_envoy_for_https_and_grpc(keyed, tmp_path):
    stack, keys, _ = keyed
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    port, admin = free_port(), free_port()
    config = render(port, admin, stack.gateway_address, stack.openai_address, tls=(cert, key))
    with tempfile.TemporaryDirectory() as workdir:
        envoy = start_envoy(
            config, workdir, admin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    try:
        body = json.dumps(CHAT).encode()
        request = urllib.request.Request(
            f"https://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {keys['open']}"},
        )
        with urllib.request.urlopen(
            request, timeout=30, context=ssl.create_default_context(cafile=cert)
        ) as response:
            assert json.load(response)["choices"]
        with pytest.raises(OSError):  # plain HTTP on the TLS port: refused
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        credentials = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            reply = inference_pb2_grpc.InferenceStub(channel).ListModels(
                inference_pb2.ListModelsRequest(),
                timeout=10,
                metadata=(("authorization", f"Bearer {keys['open']}"),),
            )
        assert reply.data
    finally:
        stop(envoy)
