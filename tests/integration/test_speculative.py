"""Speculative decoding through the whole stack: with the prompt-lookup drafter (and an EAGLE-3
head, in the worker and in the draft service), greedy replies
(chats with tools, completions, streamed or not, one at a time and concurrently) equal those
without speculation, colocated and disaggregated; usage reports the draft tokens kept and
dropped; a `prediction` drafts for its request even with no drafter configured."""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy.stack import start_stack
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.tiny_models import make_eagle3_head

WORKER_ARGS = ("--kv-cache-bytes", str(8 << 20))
DEMO_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
REQUESTS = [
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "the quick brown fox, the quick brown fox"}],
            "tools": [TOOL],
        },
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": "over the lazy dog"}]}),
    ("completions", {"prompt": "the lazy dog the lazy dog the lazy dog the"}),
    ("completions", {"prompt": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}),
]


def post(address: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://{address}/v1/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        if not body.get("stream"):
            return json.load(response)
        text, usage = "", None
        for line in response:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                usage = event.get("usage") or usage
        return {"text": text, "usage": usage}


def text_of(reply: dict) -> str:
    if "text" in reply:
        return reply["text"]
    choice = reply["choices"][0]
    return (
        choice.get("text")
        or choice["message"].get("content")
        or json.dumps(choice["message"].get("tool_calls"))
    )


def replies(address: str, concurrent: bool) -> list[tuple[str, dict]]:
    calls = [
        (
            path,
            {
                **body,
                "max_tokens": 32,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
                "stream_options": {"include_usage": True},
            }
            if stream
            else {**body, "max_tokens": 32, "temperature": 0, "ignore_eos": True},
        )
        for stream in (False, True)
        for path, body in REQUESTS
    ]
    if concurrent:
        with ThreadPoolExecutor(len(calls)) as pool:
            out = list(pool.map(lambda call: post(address, *call), calls))
    else:
        out = [post(address, *call) for call in calls]
    return [(text_of(r), r["usage"]) for r in out]


@pytest.fixture(scope="module")
def plain(chat_checkpoint):
    stack = start_stack(str(chat_checkpoint), worker_args=WORKER_ARGS)
    try:
        yield [text for text, _ in replies(stack.openai_address, concurrent=False)]
    finally:
        stack.stop()


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_replies_with_prompt_lookup_equal_replies_without(chat_checkpoint, plain, topology):
    stack = start_stack(
        str(chat_checkpoint),
        topology=topology,
        worker_args=(*WORKER_ARGS, "--kv-transport", "tcp", "--speculative", "ngram"),
    )
    try:
        for concurrent in (False, True):
            got = replies(stack.openai_address, concurrent)
            assert [text for text, _ in got] == plain
        accepted = sum(u["completion_tokens_details"]["accepted_prediction_tokens"] for _, u in got)
        rejected = sum(u["completion_tokens_details"]["rejected_prediction_tokens"] for _, u in got)
        assert accepted + rejected > 0  # drafts were verified (how many pays is the tuner's call)
        serving = stack.workers["both" if topology == "colocated" else "decode"][0]
        with grpc.insecure_channel(serving) as channel:
            health = worker_pb2_grpc.WorkerStub(channel).Health(
                worker_pb2.HealthRequest(), timeout=10
            )
        assert health.speculative == "ngram" and health.num_accepted_draft_tokens >= accepted
        assert (
            health.num_draft_tokens >= accepted + rejected
            and 0 <= health.draft_acceptance_rate <= 1
        )
    finally:
        stack.stop()


def test_replies_drafted_by_the_draft_service_equal_replies_without(chat_checkpoint, plain):
    """The target checkpoint as its own draft model: most drafts are kept."""
    stack = start_stack(
        str(chat_checkpoint),
        worker_args=WORKER_ARGS,
        draft_args=("--draft-model", str(chat_checkpoint)),
    )
    try:
        got = replies(stack.openai_address, concurrent=True)
        assert [text for text, _ in got] == plain
        accepted = sum(u["completion_tokens_details"]["accepted_prediction_tokens"] for _, u in got)
        rejected = sum(u["completion_tokens_details"]["rejected_prediction_tokens"] for _, u in got)
        assert accepted + rejected > 0 and accepted >= rejected
    finally:
        stack.stop()


@pytest.mark.parametrize("where", ["worker", "draft-service"])
def test_replies_drafted_by_an_eagle3_head_equal_replies_without(
    chat_checkpoint, plain, tmp_path, where
):
    """Disaggregated: the decode worker drafts from the hidden states of the positions it computed."""
    make_eagle3_head(str(chat_checkpoint), tmp_path)
    local = where == "worker"
    stack = start_stack(
        str(chat_checkpoint),
        topology="disaggregated",
        worker_args=(
            *WORKER_ARGS,
            "--kv-transport",
            "tcp",
            *(("--speculative", "eagle3", "--draft-model", str(tmp_path)) if local else ()),
        ),
        draft_args=None if local else ("--draft-model", str(tmp_path)),
    )
    try:
        got = replies(stack.openai_address, concurrent=True)
        assert [text for text, _ in got] == plain
        with grpc.insecure_channel(stack.workers["decode"][0]) as channel:
            health = worker_pb2_grpc.WorkerStub(channel).Health(
                worker_pb2.HealthRequest(), timeout=10
            )
        # drafts were verified (a random head's are mostly wrong)
        assert health.num_draft_tokens > 0
    finally:
        stack.stop()


def test_killing_the_draft_service_mid_stream_loses_no_request(chat_checkpoint, plain):
    # slow steps: time to act
    stack = start_stack(
        str(chat_checkpoint),
        worker_args=WORKER_ARGS,
        draft_args=("--draft-model", str(chat_checkpoint)),
        worker_env={"both": {"TANDEM_FAULTS": "step_delay_s=0.05"}},
    )
    try:
        path, body = REQUESTS[0]
        request = urllib.request.Request(
            f"http://{stack.openai_address}/v1/{path}",
            headers={"Content-Type": "application/json"},
            data=json.dumps(
                {**body, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True}
            ).encode(),
        )
        text, events = "", 0
        with urllib.request.urlopen(request, timeout=60) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    events += 1
                    if events == 2:
                        stack.processes[0].kill()  # the draft service, started first
                    for choice in json.loads(line[6:]).get("choices", []):
                        text += (choice.get("delta") or {}).get("content") or ""
        assert text == plain[0] and events > 2
    finally:
        stack.stop()


def test_a_prediction_speeds_its_own_reply_without_a_drafter():
    """On the demo model, whose replies are real text (a prediction is text, tokenized again)."""
    stack = start_stack(DEMO_MODEL, worker_args=WORKER_ARGS)
    try:
        body = {
            "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
            "max_tokens": 40,
            "temperature": 0,
        }
        want = text_of(post(stack.openai_address, "chat/completions", body))
        reply = post(
            stack.openai_address,
            "chat/completions",
            {
                **body,
                "prediction": {"type": "content", "content": [{"type": "text", "text": want}]},
            },
        )
        assert text_of(reply) == want
        details = reply["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= reply["usage"]["completion_tokens"] // 2
        bad = urllib.request.Request(
            f"http://{stack.openai_address}/v1/chat/completions",
            data=json.dumps({**body, "prediction": {"type": "image", "content": "x"}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=30)
        assert refused.value.code == 400 and b"prediction" in refused.value.read()
    finally:
        stack.stop()
