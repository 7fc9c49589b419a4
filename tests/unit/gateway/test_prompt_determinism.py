"""The same gRPC chat request renders the same prompt tokens in every gateway process, whatever
its PYTHONHASHSEED: a tool schema arrives as a protobuf Struct, whose key order is not kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from deploy.processes import REPO_ROOT

RENDER = r"""
import json, sys
from google.protobuf import json_format
from services.gateway.api.grpc_api import chat_request
from services.gateway.prepare import requests
from tandem.v1 import inference_pb2

body = json.loads(sys.argv[2])
msg = json_format.ParseDict(body, inference_pb2.ChatCompletionRequest())
prepared = requests.chat(chat_request(msg), requests.ServedModel.from_folder(sys.argv[1]))
print(json.dumps(prepared.generations[0].prompt_token_ids))
"""


def test_a_tool_call_chat_renders_the_same_tokens_under_any_hash_seed():
    properties = {
        f"field_{name}": {"type": "string", "description": f"the {name}"}
        for name in (
            "city",
            "unit",
            "date",
            "zone",
            "lang",
            "query",
            "limit",
            "page",
            "sort",
            "fmt",
        )
    }
    body = {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "look it up",
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": sorted(properties),
                    },
                },
            }
        ],
    }
    model = os.path.join(REPO_ROOT, "demo", "tandem-demo")
    renders = set()
    for seed in ("0", "1", "2", "3", "random"):
        out = subprocess.run(
            [sys.executable, "-c", RENDER, model, json.dumps(body)],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        renders.add(out.stdout.strip())
    assert len(renders) == 1
    assert len(json.loads(renders.pop())) > 50
