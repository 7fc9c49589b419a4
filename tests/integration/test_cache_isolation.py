"""Prompt caches isolated by cache salt, with real processes: with API keys on, a second key
sending the same long prompt gets cached_tokens 0 unless both keys share a `cache_salt` in the
keys file, while each key's repeat still hits; a request's own `cache_salt` (chat, completions,
Responses, Messages) does the same without keys. Through a colocated stack with the KV store
on (the store serves a prompt only to its own salt) and a disaggregated one (the salted KV
moves to the decode worker and is accepted there)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import grpc
import pytest

from deploy.stack import start_stack
from services.gateway.api_keys import add_key
from tandem.v1 import inference_pb2, inference_pb2_grpc
from tests.integration.test_kv_store import WORKER_ARGS, by_tier, store_stats, wait_until

BLOCK = 16
NUM_BLOCKS = 8
HANG_GUARD_S = 30


def prompt(seed: int) -> list[int]:
    """A prompt of NUM_BLOCKS full blocks and a few tokens, different for each seed."""
    return [(i * 13 + seed * 101) % 370 + 3 for i in range(NUM_BLOCKS * BLOCK + 5)]


def post(address: str, path: str, body: dict, key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        f"http://{address}{path}", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{path}: {exc.code} {exc.read()!r}") from None


def cached(address: str, tokens: list[int], key: str | None = None, **fields) -> int:
    """The prompt's cached tokens in a greedy completion of `tokens`."""
    body = {"prompt": tokens, "max_tokens": 2, "temperature": 0, **fields}
    return post(address, "/v1/completions", body, key)["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def make_keys(path: str) -> dict[str, str]:
    """alice and carol share a cache salt; bob has his own (the default: his key's name)."""
    keys = {name: add_key(path, name) for name in ("alice", "bob", "carol")}
    with open(path) as f:
        raw = json.load(f)
    for item in raw["keys"]:
        if item["name"] in ("alice", "carol"):
            item["cache_salt"] = "team"
    with open(path, "w") as f:
        json.dump(raw, f)
    return keys


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cache-keys") / "keys.json")
    return path, make_keys(path)


def replace_worker(stack, model: str, key: str) -> None:
    """Kills the stack's worker and serves from a new one with an empty cache (as
    test_kv_store's, with a key: Health names workers only to a key holder)."""
    [old] = stack.workers["both"]
    stack.worker_processes[old].kill()
    new = stack.start_worker(
        "both", model, "--host", "127.0.0.1", *WORKER_ARGS, "--kv-store", stack.kv_store_address
    )
    stack.workers["both"].remove(old)
    stack.write_workers_file()

    def routable():
        with grpc.insecure_channel(stack.gateway_address) as channel:
            health = inference_pb2_grpc.InferenceStub(channel).Health(
                inference_pb2.HealthCheckRequest(),
                timeout=5,
                metadata=[("authorization", f"Bearer {key}")],
            )
        return {w.address for w in health.workers if w.healthy} == {new}

    wait_until(routable, "the new worker to be the only one routed to")


def assert_keys_isolated(address: str, keys: dict[str, str], tokens: list[int]) -> None:
    full = NUM_BLOCKS * BLOCK
    assert cached(address, tokens, keys["alice"]) == 0
    assert cached(address, tokens, keys["alice"]) == full  # the same key's repeat hits
    assert cached(address, tokens, keys["bob"]) == 0  # another key does not
    assert cached(address, tokens, keys["carol"]) == full  # a key sharing alice's salt does
    assert cached(address, tokens, keys["bob"]) == full
    # a request's own salt splits its key's cache further
    assert cached(address, tokens, keys["alice"], cache_salt="private") == 0
    assert cached(address, tokens, keys["alice"], cache_salt="private") == full
    assert cached(address, tokens, keys["carol"], cache_salt="private") == full
    assert cached(address, tokens, keys["bob"], cache_salt="private") == 0


def test_keys_isolate_caches_colocated_and_the_kv_store_serves_only_the_same_salt(
    chat_checkpoint, keys_path, tmp_path
):
    path, keys = keys_path
    model = str(chat_checkpoint)
    stack = start_stack(
        model,
        worker_args=WORKER_ARGS,
        gateway_args=("--api-keys-file", path),
        kv_store_args=("--kv-transport", "tcp", "--disk-dir", str(tmp_path / "kvcache")),
    )
    try:
        # The store holds alice's blocks of a prompt; a worker with an empty cache serves them
        # to her salt only.
        tokens = prompt(2)
        assert cached(stack.openai_address, tokens, keys["alice"]) == 0
        wait_until(
            lambda: store_stats(stack.kv_store_address).dram.blocks >= NUM_BLOCKS,
            "alice's write-through to land",
        )
        replace_worker(stack, model, keys["alice"])
        body = {"prompt": tokens, "max_tokens": 2, "temperature": 0}
        bob = post(stack.openai_address, "/v1/completions", body, keys["bob"])
        assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        carol = post(stack.openai_address, "/v1/completions", body, keys["carol"])
        assert by_tier(carol)["store_dram"] == NUM_BLOCKS * BLOCK  # alice's salt: from the store

        assert_keys_isolated(stack.openai_address, keys, prompt(1))
    finally:
        stack.stop()


def test_keys_isolate_caches_disaggregated(chat_checkpoint, keys_path):
    path, keys = keys_path
    stack = start_stack(
        str(chat_checkpoint),
        topology="disaggregated",
        worker_args=(*WORKER_ARGS, "--kv-transport", "tcp"),
        gateway_args=("--api-keys-file", path, "--request-timeout-s", "30"),
    )
    try:
        assert_keys_isolated(stack.openai_address, keys, prompt(3))
    finally:
        stack.stop()


def test_a_request_cache_salt_isolates_without_keys_on_every_surface(services_stack):
    address, full = services_stack.openai_address, NUM_BLOCKS * BLOCK
    tokens = prompt(4)
    assert cached(address, tokens) == 0
    assert cached(address, tokens) == full  # unsalted, as before
    assert cached(address, tokens, cache_salt="a") == 0
    assert cached(address, tokens, cache_salt="a") == full
    assert cached(address, tokens, cache_salt="b") == 0

    content = "the lazy dog jumps over the quick brown fox " * 12

    def chat(salt: str) -> int:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
        usage = post(address, "/v1/chat/completions", {**body, "cache_salt": salt})["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    def responses(salt: str) -> int:
        body = {"input": content, "max_output_tokens": 2, "cache_salt": salt}
        return post(address, "/v1/responses", body)["usage"]["input_tokens_details"][
            "cached_tokens"
        ]

    def messages(salt: str) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
            "cache_salt": salt,
        }
        return post(address, "/v1/messages", body)["usage"]["cache_read_input_tokens"]

    model = os.path.basename(os.path.normpath(services_stack.folder))
    for surface in (chat, responses, messages):
        salt = f"{surface.__name__}-salt"
        assert surface(salt) == 0, surface.__name__
        assert surface(salt) > 0, surface.__name__
        assert surface(f"other-{salt}") == 0, surface.__name__
