"""Claude Code's and Codex CLI's own requests through Envoy: their first requests as captured from
the clients (tests/fixtures/agent_clients, long texts shortened to fit a small model's context),
a tool loop in each client's request shape, the prompt cache across Claude Code sessions,
count_tokens, and refusals counted by field."""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid

import pytest
import requests

from deploy.processes import REPO_ROOT
from deploy.stack import start_stack
from tests.e2e.test_agent_apis import (
    ANSWER,
    DEMO_MODEL,
    MESSAGES_TOOL,
    MODEL,
    QUESTION,
    RESPONSES_TOOL,
    RESULT,
)

FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures", "agent_clients")
CLAUDE_FIRST, CLAUDE_TITLE = "claude_code_2.1.197_first.json", "claude_code_2.1.197_title.json"
CODEX_FIRST = "codex_0.171.0_first.json"
CONTEXT = 16384


def captured(name: str, max_chars: int = 160) -> dict:
    """A captured request with every long string cut to `max_chars` (its shape kept whole)."""
    with open(os.path.join(FIXTURES, name)) as f:
        request = json.load(f)

    def cut(value):
        if isinstance(value, str):
            return value[:max_chars]
        if isinstance(value, list):
            return [cut(v) for v in value]
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value

    request["body"] = {**cut(request["body"]), "model": MODEL}
    return request


def sse_events(response: requests.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The demo model with a 16k context (its positions past 1024 untrained: shapes, not text)."""
    folder = tmp_path_factory.mktemp("long") / MODEL
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    stack = start_stack(str(folder))
    yield stack
    stack.stop()


class Http:
    """requests against the stack's Envoy, by path."""

    def __init__(self, base: str):
        self.base, self.session = base, requests.Session()

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        return self.session.request(method, self.base + path, timeout=120, **kwargs)

    def post(self, path: str, **kwargs) -> requests.Response:
        return self.request("POST", path, **kwargs)

    def get(self, path: str) -> requests.Response:
        return self.request("GET", path)

    def head(self, path: str) -> requests.Response:
        return self.request("HEAD", path)


@pytest.fixture(scope="module")
def http(stack):
    return Http(f"http://{stack.envoy_address}")


def send(http: Http, request: dict, body: dict | None = None) -> requests.Response:
    headers = {k: v for k, v in request["headers"].items() if k.lower() != "accept-encoding"}
    return http.request(
        request["method"],
        request["path"],
        headers=headers,
        json=body if body is not None else request["body"],
    )


@pytest.mark.parametrize("name", [CLAUDE_FIRST, CLAUDE_TITLE])
def test_claude_codes_first_requests_are_served(http, name):
    request = captured(name)
    body = {**request["body"], "max_tokens": 48}
    response = send(http, request, body)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    if (
        name == CLAUDE_TITLE
    ):  # output_config.format: the reply follows the client's schema (or is cut by max_tokens)
        text = "".join(
            e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
        )
        stop = next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"]
        if stop == "end_turn":
            assert isinstance(json.loads(text)["title"], str)


def test_claude_codes_max_tokens_over_the_context_is_refused_in_anthropics_words(http):
    request = captured(CLAUDE_FIRST)
    # as the client sends it
    response = send(http, request, {**request["body"], "max_tokens": 64000})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("input length and `max_tokens` exceed context limit: ")
    assert message.endswith(
        f" + 64000 > {CONTEXT}, decrease input length or `max_tokens` and try again"
    )


def test_codex_first_request_is_served_without_its_hosted_tool(http):
    request = captured(CODEX_FIRST)
    response = send(http, request, {**request["body"], "max_output_tokens": 32})
    assert response.status_code == 200, response.text
    assert "web_search" in response.headers["x-tandem-warning"]
    events = sse_events(response)
    assert events[0]["type"] == "response.created" and events[-1]["type"] in (
        "response.completed",
        "response.incomplete",
    )


def test_a_tool_loop_in_claude_codes_request_shape(http):
    request = captured(CLAUDE_FIRST)
    envelope = {
        k: v for k, v in request["body"].items() if k not in ("messages", "tools", "system")
    }
    # the billing header alone: dropped from the prompt
    envelope.update(
        max_tokens=64, temperature=0, tools=[MESSAGES_TOOL], system=[request["body"]["system"][0]]
    )
    question = [{"role": "user", "content": QUESTION}]
    first = sse_events(send(http, request, {**envelope, "messages": question}))
    [use] = [
        e["content_block"]
        for e in first
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"
    ]
    arguments = "".join(
        e["delta"]["partial_json"]
        for e in first
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert use["name"] == "get_weather" and json.loads(arguments)["city"] == "Paris"
    turn = {"role": "assistant", "content": [{**use, "input": json.loads(arguments)}]}
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": RESULT}],
    }
    second = sse_events(send(http, request, {**envelope, "messages": question + [turn, result]}))
    text = "".join(e["delta"].get("text", "") for e in second if e["type"] == "content_block_delta")
    assert text == ANSWER


def test_a_tool_loop_in_codexs_request_shape(http):
    request = captured(CODEX_FIRST)
    envelope = {k: v for k, v in request["body"].items() if k not in ("input", "tools")}
    envelope.update(
        temperature=0, tools=[RESPONSES_TOOL, {"type": "web_search", "external_web_access": False}]
    )
    question = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
    ]
    first = sse_events(send(http, request, {**envelope, "input": question}))
    [call] = [
        e["item"]
        for e in first
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
    ]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] == "Paris"
    # store: false, as Codex sends it: the whole conversation again, with the call's output.
    history = question + [
        {k: call[k] for k in ("type", "call_id", "name", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT},
    ]
    second = sse_events(send(http, request, {**envelope, "input": history}))
    done = second[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == ANSWER


def test_a_new_claude_code_session_reads_everything_before_its_prompt_from_the_cache(http):
    request = captured(CLAUDE_FIRST)
    usages = []
    for session in range(2):  # each session: its own billing header and first prompt
        body = copy.deepcopy(request["body"])
        body["system"][0]["text"] = (
            f"x-anthropic-billing-header: cc_version=2.1.197.{uuid.uuid4().hex[:3]};"
        )
        body["messages"][0]["content"][-1]["text"] = f"Question {session}: {uuid.uuid4().hex}"
        body.update(max_tokens=4, stream=False)
        counted = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        reply = send(http, request, body).json()
        assert "usage" in reply, reply
        usage = reply["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted
        usages.append(usage)
    second = usages[1]
    prompt = second["input_tokens"] + second["cache_read_input_tokens"]
    assert second["cache_read_input_tokens"] >= 0.9 * prompt, usages


def test_count_tokens_equals_a_cold_requests_input_tokens(http):
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "system": f"Session {uuid.uuid4().hex}.",
        "messages": [{"role": "user", "content": "Hello there!"}],
        "tools": [MESSAGES_TOOL],
    }
    counted = http.post(
        "/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"}
    )
    assert counted.status_code == 200
    reply = http.post("/v1/messages", json=body).json()
    assert counted.json()["input_tokens"] == reply["usage"]["input_tokens"] > 0
    assert reply["usage"]["cache_read_input_tokens"] == 0


def test_refusals_are_counted_by_field_and_probes_answered(http, stack):
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
        "mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}],
    }
    for _ in range(2):
        refused = http.post("/v1/messages", json=body)
        assert refused.status_code == 400 and "mcp_servers" in refused.json()["error"]["message"]
    metrics = http.get("/metrics").text
    line = next(
        m
        for m in metrics.splitlines()
        if m.startswith("tandem:requests_refused_total{") and 'field="mcp_servers"' in m
    )
    assert 'surface="messages"' in line and 'status="400"' in line and float(line.split()[-1]) >= 2
    assert http.head("/").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == CONTEXT


def test_the_model_list_serves_both_apis_with_the_context_length(stack):
    import anthropic

    listed = anthropic.Anthropic(
        base_url=f"http://{stack.envoy_address}", api_key="none"
    ).models.list()
    [model] = listed.data
    assert (
        model.id == MODEL
        and model.type == "model"
        and model.model_extra["max_model_len"] == CONTEXT
    )
