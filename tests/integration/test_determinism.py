"""A fresh stack gives the same greedy replies as the one before it, with gateways of different
PYTHONHASHSEED: tool-call chats over gRPC, whose tool schemas travel as protobuf Structs."""

from __future__ import annotations

import grpc
from google.protobuf import json_format

from deploy.stack import start_stack
from tandem.v1 import inference_pb2, inference_pb2_grpc

TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {  # short: the test model's context is 512
            "type": "object",
            "properties": {name: {"type": "string"} for name in ("c", "u", "d", "z", "l", "q")},
        },
    },
}


def replies(chat_checkpoint, hash_seed: str) -> list[str]:
    stack = start_stack(
        str(chat_checkpoint),
        worker_args=("--kv-cache-bytes", str(8 << 20)),
        gateway_env={"PYTHONHASHSEED": hash_seed},
    )
    try:
        with grpc.insecure_channel(stack.gateway_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            out = []
            for content in ("the fox", "the lazy dog", "quick brown", "over the"):
                request = json_format.ParseDict(
                    {
                        "messages": [{"role": "user", "content": content}],
                        "tools": [TOOL],
                        "max_tokens": 12,
                        "temperature": 0,
                    },
                    inference_pb2.ChatCompletionRequest(),
                )
                reply = stub.CreateChatCompletion(request, timeout=30)
                out.append(
                    (reply.usage.prompt_tokens, reply.choices[0].message.content.string_value)
                )
            return out
    finally:
        stack.stop()


def test_fresh_stacks_with_different_hash_seeds_reply_alike(chat_checkpoint):
    first = replies(chat_checkpoint, "1")
    assert first == replies(chat_checkpoint, "2")
    assert all(tokens > 50 for tokens, _ in first)  # the tool schema is in every prompt
