"""API keys (services/gateway/api_keys.py): a hashed keys file, Bearer authentication, per-key
request and token limits over a sliding minute with the wait until the window allows, a cap on
requests in flight, weights and scopes, usage counted per key name, reloads without a restart,
and clear errors for a bad file."""

from __future__ import annotations

import json

import grpc
import pytest

from services.gateway import metrics
from services.gateway.api_keys import ApiKeys, add_key, key_hash, read_entries
from services.gateway.errors import GatewayError
from services.gateway.pricing import Prices
from services.gateway.protocol import Usage


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample(name: str, *labels: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value(
            name, dict(zip(("key", "kind" if "tokens" in name else "reason"), labels))
        )
        or 0.0
    )


def test_add_key_stores_only_the_hash_and_the_key_authenticates(tmp_path):
    path = str(tmp_path / "keys.json")
    key = add_key(path, "team-a", requests_per_minute=5)
    other = add_key(path, "team-b")
    text = open(path).read()
    assert key not in text and other not in text and key_hash(key) in text
    assert [(e.name, e.requests_per_minute) for e in read_entries(path)] == [
        ("team-a", 5),
        ("team-b", 0),
    ]
    keys = ApiKeys(path)
    assert keys.authenticate(f"Bearer {key}").name == "team-a"
    assert keys.authenticate(f"bearer  {other} ").name == "team-b"
    with pytest.raises(ValueError, match="already has a key named 'team-a'"):
        add_key(path, "team-a")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic dXNlcjpwYXNz", "Bearer wrong-key"])
def test_a_missing_or_wrong_key_is_unauthenticated_and_never_echoed(tmp_path, header):
    path = str(tmp_path / "keys.json")
    add_key(path, "team-a")
    with pytest.raises(GatewayError) as caught:
        ApiKeys(path).authenticate(header)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "wrong-key" not in caught.value.message


def test_a_request_limit_refuses_with_the_wait_and_admits_again_after_the_window(tmp_path):
    path, clock = str(tmp_path / "keys.json"), Clock()
    key = add_key(path, "rpm", requests_per_minute=3)
    caller = ApiKeys(path, clock).authenticate(f"Bearer {key}")
    before = sample("tandem:api_key_rejected_total", "rpm", "requests")
    for _ in range(3):
        caller.admit(10)
        clock.now += 10
    with pytest.raises(GatewayError) as caught:
        caller.admit(10)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the first request leaves the window 60 s after it came
    assert caught.value.retry_after_s == 30
    assert sample("tandem:api_key_rejected_total", "rpm", "requests") == before + 1
    clock.now += 30
    caller.admit(10)


def test_a_token_limit_counts_prompt_and_completion_tokens(tmp_path):
    path, clock = str(tmp_path / "keys.json"), Clock()
    key = add_key(path, "tpm", tokens_per_minute=100)
    caller = ApiKeys(path, clock).authenticate(f"Bearer {key}")
    caller.admit(60)
    clock.now += 5
    caller.generated(30)
    clock.now += 5
    caller.admit(5)  # 90 used: under the limit
    caller.generated(10)  # 105
    clock.now += 5
    with pytest.raises(GatewayError) as caught:
        caller.admit(1)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.retry_after_s == 45  # when the first 60 tokens leave the window
    clock.now += 45
    caller.admit(1)


def test_usage_is_billed_per_key_name(tmp_path):
    path = str(tmp_path / "keys.json")
    key = add_key(path, "billed")
    caller = ApiKeys(path).authenticate(f"Bearer {key}")
    prompt, cached, completion = (
        sample("tandem:api_key_tokens_total", "billed", kind)
        for kind in ("prompt", "cached", "completion")
    )
    caller.bill(
        Usage(prompt_tokens=100, completion_tokens=20, cached_tokens=64),
        Prices(input=1.0, cached_input=0.5, output=2.0),
    )
    assert sample("tandem:api_key_tokens_total", "billed", "prompt") == prompt + 100
    assert sample("tandem:api_key_tokens_total", "billed", "cached") == cached + 64
    assert sample("tandem:api_key_tokens_total", "billed", "completion") == completion + 20
    assert metrics.REGISTRY.get_sample_value(
        "tandem:api_key_cost_usd_total", {"key": "billed"}
    ) == pytest.approx((36 * 1.0 + 64 * 0.5 + 20 * 2.0) / 1e6)


def test_the_file_is_reread_when_it_changes_and_a_broken_one_keeps_the_old_keys(tmp_path):
    path, clock = str(tmp_path / "keys.json"), Clock()
    first = add_key(path, "first")
    keys = ApiKeys(path, clock)
    second = add_key(path, "second")
    clock.now += 2
    assert keys.authenticate(f"Bearer {second}").name == "second"
    with open(path, "w") as f:
        json.dump({"keys": [{"name": "second", "sha256": key_hash(second)}]}, f)  # first revoked
    clock.now += 2
    with pytest.raises(GatewayError):
        keys.authenticate(f"Bearer {first}")
    with open(path, "w") as f:
        f.write("{not json")
    clock.now += 2
    assert keys.authenticate(f"Bearer {second}").name == "second"


def test_past_max_concurrent_requests_a_caller_gets_429_until_one_finishes(tmp_path):
    path = str(tmp_path / "keys.json")
    key = add_key(path, "capped", max_concurrent_requests=2)
    caller = ApiKeys(path).authenticate(f"Bearer {key}")
    before = sample("tandem:api_key_rejected_total", "capped", "concurrent")
    caller.admit(10)
    caller.admit(10)
    with pytest.raises(GatewayError) as caught:
        caller.admit(10)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.retry_after_s == 1 and "2 requests in flight" in caught.value.message
    assert sample("tandem:api_key_rejected_total", "capped", "concurrent") == before + 1
    caller.finished()
    caller.admit(10)
    assert caller.num_in_flight == 2


def test_weight_and_scopes_are_stored_read_back_and_default_to_1_and_none(tmp_path):
    path = str(tmp_path / "keys.json")
    add_key(path, "heavy", weight=3, max_concurrent_requests=8)
    add_key(path, "ops", scopes=("metrics",))
    add_key(path, "plain")
    stored = {item["name"]: item for item in json.load(open(path))["keys"]}
    assert set(stored["plain"]) == {"name", "sha256"}  # defaults are not written
    assert stored["ops"]["scopes"] == ["metrics"]
    entries = {e.name: e for e in read_entries(path)}
    assert (entries["heavy"].weight, entries["heavy"].max_concurrent_requests) == (3, 8)
    assert entries["ops"].scopes == ("metrics",) and entries["plain"].scopes == ()
    assert entries["plain"].weight == 1


@pytest.mark.parametrize(
    "content, message",
    [
        ("[]", 'expected {"keys"'),
        ('{"keys": [{"name": "a", "sha256": "abc"}]}', "64 lowercase hex"),
        ('{"keys": [{"name": "a", "key": "plain"}]}', "never holds keys"),
        (
            '{"keys": [{"name": "a", "sha256": "' + "0" * 64 + '", "requests_per_minute": -1}]}',
            "whole number",
        ),
        ('{"keys": [{"name": "a", "sha256": "' + "0" * 64 + '", "weight": 0}]}', "weight"),
        ('{"keys": [{"name": "a", "sha256": "' + "0" * 64 + '", "scopes": ["admin"]}]}', "metrics"),
    ],
)
def test_a_bad_keys_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        ApiKeys(str(path))
