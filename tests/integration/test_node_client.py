"""A gRPC client in another language (Node's @grpc/grpc-js) calls the public API through Envoy."""

from __future__ import annotations

import json
import os
import subprocess

import google.api
from google.protobuf import json_format

from deploy.processes import REPO_ROOT
from tandem.v1 import inference_pb2, inference_pb2_grpc

NODE_CLIENT = os.path.join(REPO_ROOT, "tests", "clients", "node")
GOOGLEAPIS = os.path.dirname(os.path.dirname(list(google.api.__path__)[0]))


def test_node_grpc_client_streams_through_envoy(services_stack, envoy_address):
    out = subprocess.run(
        [
            "node",
            "chat.js",
            envoy_address,
            os.path.join(REPO_ROOT, "protos"),
            GOOGLEAPIS,
            "the quick fox",
        ],
        cwd=NODE_CLIENT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    request = json_format.ParseDict(
        {
            "messages": [{"role": "user", "content": "the quick fox"}],
            "max_tokens": 12,
            "temperature": 0,
        },
        inference_pb2.ChatCompletionRequest(),
    )
    expected = inference_pb2_grpc.InferenceStub(
        services_stack.gateway_channel
    ).CreateChatCompletion(request, timeout=30)
    assert result["unary"] == expected.choices[0].message.content.string_value
    assert result["streamed"] == result["unary"]
    assert result["chunks"] >= 3  # role, content..., finish
    assert result["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
