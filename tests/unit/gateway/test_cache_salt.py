"""Cache salts at the gateway: each API key salts its requests (its `cache_salt` from the keys
file, else its name), a request's own `cache_salt` (any surface) salts further, and routing
matches a prefix only under the salt its blocks were cached with."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.block_hash import hash_blocks, salt_root
from services.gateway.api import messages_api, responses_api
from services.gateway.api.openai_models import ChatCompletionBody, CompletionBody
from services.gateway.api_keys import ApiKeys, key_hash
from services.gateway.prepare.requests import Prepared, key_salted
from services.gateway.protocol import GenerationRequest, SamplingOptions
from services.gateway.routing.affinity import AffinityTable
from services.gateway.routing.endpoints import EndpointSet
from services.gateway.routing.policies.kv import KVPolicy
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.worker_pool import WorkerPool
from tests.unit.gateway.fake_worker import FakeWorker


def keys_file(tmp_path, *entries: dict) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": list(entries)}))
    return str(path)


def entry(name: str, **fields) -> dict:
    return {"name": name, "sha256": key_hash(f"key-{name}"), **fields}


def salt_of(keys: ApiKeys, name: str, request_salt: str = "") -> str:
    """The salt a worker gets for a request by key `name` with `request_salt`."""
    caller = keys.authenticate(f"Bearer key-{name}")
    prepared = Prepared(
        "r", [GenerationRequest("r-0", [1, 2], SamplingOptions(), "", [], request_salt)], 1
    )
    return key_salted(prepared, caller.cache_salt).generations[0].cache_salt


def test_each_key_has_its_own_salt_unless_keys_share_one(tmp_path):
    keys = ApiKeys(
        keys_file(
            tmp_path,
            entry("alice", cache_salt="team"),
            entry("carol", cache_salt="team"),
            entry("bob"),
            entry("dave"),
        )
    )
    assert salt_of(keys, "alice") == salt_of(keys, "carol")
    assert len({salt_of(keys, "alice"), salt_of(keys, "bob"), salt_of(keys, "dave")}) == 3
    # a request's salt splits a key's cache further, and only within that key
    assert salt_of(keys, "bob", "x") not in (salt_of(keys, "bob"), salt_of(keys, "dave", "x"))
    assert salt_of(keys, "bob", "x") == salt_of(keys, "bob", "x")
    # every keyed salt is non-empty: nothing keyed shares the unkeyed cache
    assert all(salt_of(keys, name) for name in ("alice", "bob"))


def test_a_request_salt_cannot_spell_another_keys_salt(tmp_path):
    keys = ApiKeys(keys_file(tmp_path, entry("a", cache_salt="t"), entry("b", cache_salt="t:x")))
    salts = {
        salt_of(keys, "a", "x"),
        salt_of(keys, "a", "x:"),
        salt_of(keys, "b"),
        salt_of(keys, "b", ""),
    }
    assert len(salts) == 3  # b with and without an empty request salt are the same


def test_a_keys_file_cache_salt_must_be_a_string(tmp_path):
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        ApiKeys(keys_file(tmp_path, entry("a", cache_salt=7)))


def test_every_surface_reads_a_request_cache_salt():
    chat = ChatCompletionBody(messages=[{"role": "user", "content": "hi"}], cache_salt="s1")
    assert chat.to_request().cache_salt == "s1"
    assert ChatCompletionBody(messages=[]).to_request().cache_salt == ""
    assert CompletionBody(prompt=[1, 2], cache_salt="s2").to_request().cache_salt == "s2"
    body = messages_api.MessagesBody(
        model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}], cache_salt="s3"
    )
    assert messages_api.Messages.request(body, "")[0].cache_salt == "s3"
    assert responses_api.ResponsesBody(input="hi", cache_salt="s4").cache_salt == "s4"


async def route_prompt(prompt: list[int], request_salts: list[str]) -> list[list[str]]:
    """Two fake workers: A holds `prompt`'s blocks unsalted, B under salt "s" (as each one's KV
    events would report them). For each salt, the workers its request ran on (KV routing)."""
    workers = [await FakeWorker("both").start() for _ in range(2)]
    endpoints = EndpointSet({"both": [w.address for w in workers]})
    await endpoints.refresh()
    a, b = sorted(endpoints.endpoints(), key=lambda e: e.address != workers[0].address)
    index = PrefixIndex()
    index.stored(a, hash_blocks(prompt, 16))
    index.stored(b, hash_blocks(prompt, 16, salt_root("s")))
    pool = WorkerPool(endpoints, 5.0, 5.0, KVPolicy(index), AffinityTable())
    try:
        ran_on = []
        for i, salt in enumerate(request_salts):
            request = GenerationRequest(
                f"r{i}", prompt, SamplingOptions(max_tokens=4), cache_salt=salt
            )
            async for _ in pool.generate(request):
                pass
            ran_on.append(
                ["A", "B"][[f"r{i}" in w.called("Generate") for w in workers].index(True)]
            )
        return ran_on
    finally:
        await pool.close()
        for worker in workers:
            await worker.stop()


def test_routing_finds_a_prefix_only_under_its_salt():
    """The gateway hashes a prompt as the workers do under the same salt: a salted request is
    routed to the worker holding its salted blocks, an unsalted one to the unsalted holder."""
    assert asyncio.run(route_prompt(list(range(3, 103)), ["", "s", "", "s"])) == [
        "A",
        "B",
        "A",
        "B",
    ]
