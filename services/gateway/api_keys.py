"""API keys and per-key limits (`--api-keys-file`; `API_KEYS_FILE=` in `make run`).

The file is JSON and holds each key's SHA-256, never the key itself:

    {"keys": [{"name": "team-a", "sha256": "9f86d0...", "requests_per_minute": 60,
               "tokens_per_minute": 200000, "max_concurrent_requests": 32, "weight": 2},
              {"name": "ops", "sha256": "60303a...", "scopes": ["metrics"]}]}

Limits are optional (absent or 0: none). `weight` (default 1) is the key's share of the
admission queue's turns (admission.py); `scopes: ["metrics"]` lets the key read the gateway's
/metrics through the public port (every key's names, traffic and spend, so an operator's key,
not a tenant's). `python -m services.gateway.api_keys FILE NAME [--requests-per-minute N]
[--tokens-per-minute N] [--max-concurrent-requests N] [--weight N] [--scope metrics]` makes a
key, adds its hash under NAME and prints the key, once. The gateway re-reads the file when it
changes (looking at most once a second), so keys are added, limited or revoked without a
restart; a file that no longer parses keeps the keys read before, with a warning. Without
the file every caller is served.

Each key's prompts are cached apart from every other key's: its `cache_salt` (default: its
name) salts their block hashes (engine/block_hash.py), so keys given the same
`"cache_salt": "tenant-a"` share cached prefixes and no others do.

With keys, a call carries `Authorization: Bearer KEY` (gRPC: the `authorization` metadata,
which Envoy passes through from REST). A missing or unknown key is UNAUTHENTICATED (HTTP 401).
Each key's limits count over the last WINDOW_S seconds: requests as they are admitted, tokens
(prompt and completion) as they become known. A caller at either limit is RESOURCE_EXHAUSTED
(HTTP 429) with Retry-After: the seconds until enough of the window has passed. A caller with
`max_concurrent_requests` requests in flight (queued or running) gets the same, with
Retry-After 1. Usage is counted per key name in metrics (metrics.py: `tandem:api_key_*`). No
key reaches a log line, a metric or an error message: only names do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import secrets
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.gateway import metrics
from services.gateway.errors import GatewayError
from services.gateway.pricing import Prices
from services.gateway.protocol import Usage

log = logging.getLogger(__name__)

WINDOW_S = 60.0
RELOAD_EVERY_S = 1.0
KEY_PREFIX = "tandem-"
METRICS_SCOPE = "metrics"  # may read /metrics on the public port
SCOPES = (METRICS_SCOPE,)  # what a key may do besides calling the API


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyEntry:
    name: str
    sha256: str
    requests_per_minute: int = 0  # 0: no limit
    tokens_per_minute: int = 0
    max_concurrent_requests: int = 0  # 0: no limit
    weight: int = 1  # turns in the admission queue, relative to other keys
    scopes: tuple[str, ...] = ()  # of SCOPES
    # keys with the same salt share cached prompt prefixes; "" (the default): the key's name,
    # so no other key shares them
    cache_salt: str = ""


def read_entries(path: str) -> list[KeyEntry]:
    """The file's keys; ValueError (naming the file and what is wrong) if it is not a keys file."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as exc:
        raise ValueError(f"API keys file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"API keys file {path} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("keys"), list):
        raise ValueError(f'API keys file {path}: expected {{"keys": [...]}}')
    entries, names = [], set()
    for i, item in enumerate(raw["keys"]):
        where = f"API keys file {path}, key {i}"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f"{where}: needs a non-empty string 'name'")
        digest = item.get("sha256")
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise ValueError(
                f"{where} ({item['name']}): 'sha256' must be the key's SHA-256 in 64 lowercase hex "
                "digits (the file never holds keys themselves)"
            )
        limits = {}
        for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
            value = item.get(field, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where} ({item['name']}): {field} must be a whole number >= 0")
            limits[field] = value
        weight = item.get("weight", 1)
        if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
            raise ValueError(f"{where} ({item['name']}): weight must be a whole number >= 1")
        scopes = item.get("scopes", [])
        if not isinstance(scopes, list) or any(scope not in SCOPES for scope in scopes):
            raise ValueError(
                f"{where} ({item['name']}): scopes must be a list of {', '.join(SCOPES)}"
            )
        limits.update(weight=weight, scopes=tuple(scopes))
        cache_salt = item.get("cache_salt", "")
        if not isinstance(cache_salt, str):
            raise ValueError(f"{where} ({item['name']}): cache_salt must be a string")
        limits["cache_salt"] = cache_salt
        if item["name"] in names:
            raise ValueError(f"{where}: the name {item['name']!r} is used twice")
        names.add(item["name"])
        entries.append(KeyEntry(item["name"], digest, **limits))
    return entries


class Window:
    """Amounts over the last WINDOW_S seconds."""

    def __init__(self):
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def _expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - WINDOW_S:
            self.total -= self.events.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        self._expire(now)
        if amount:
            self.events.append((now, amount))
            self.total += amount

    def wait_s(self, now: float, limit: int) -> float:
        """0 if the window holds less than `limit`; else the seconds until it does."""
        self._expire(now)
        excess = self.total - limit + 1
        for when, amount in self.events:
            if excess <= 0:
                break
            excess -= amount
            if excess <= 0:
                return when + WINDOW_S - now
        return 0.0


class Caller:
    """An authenticated key's name, limits and windows."""

    def __init__(self, entry: KeyEntry, clock: Callable[[], float]):
        self.entry = entry
        self.clock = clock
        self.requests = Window()
        self.tokens = Window()
        self.num_in_flight = 0  # requests admitted and not yet finished

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def cache_salt(self) -> str:
        """What salts its prompts' block hashes (engine/block_hash.py): the key's `cache_salt`,
        else its name."""
        return self.entry.cache_salt or self.entry.name

    def admit(self, prompt_tokens: int) -> None:
        """Counts a request and its prompt tokens, or raises RESOURCE_EXHAUSTED (with when to retry).
        Every request admitted is ended with `finished`."""
        now, entry = self.clock(), self.entry
        if entry.max_concurrent_requests and self.num_in_flight >= entry.max_concurrent_requests:
            metrics.KEY_REJECTED.labels(self.name, "concurrent").inc()
            # no window to wait out: one of its requests finishing frees the place
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"concurrency limit reached for API key {self.name!r}: "
                f"{entry.max_concurrent_requests} requests in flight; retry when one finishes",
                retry_after_s=1,
            )
        for limit, window, what in (
            (entry.requests_per_minute, self.requests, "requests"),
            (entry.tokens_per_minute, self.tokens, "tokens"),
        ):
            wait = window.wait_s(now, limit) if limit else 0.0
            if wait > 0:
                metrics.KEY_REJECTED.labels(self.name, what).inc()
                raise GatewayError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"rate limit reached for API key {self.name!r}: {limit} {what} per minute; "
                    f"retry in {math.ceil(wait)} s",
                    retry_after_s=max(1, math.ceil(wait)),
                )
        self.requests.add(now, 1)
        self.tokens.add(now, prompt_tokens)
        self.num_in_flight += 1
        metrics.KEY_REQUESTS.labels(self.name).inc()

    def finished(self) -> None:
        self.num_in_flight -= 1

    def generated(self, tokens: int) -> None:
        self.tokens.add(self.clock(), tokens)

    def bill(self, usage: Usage, prices: Prices | None) -> None:
        """A finished request's usage, into the per-key metrics."""
        metrics.KEY_TOKENS.labels(self.name, "prompt").inc(usage.prompt_tokens)
        metrics.KEY_TOKENS.labels(self.name, "cached").inc(usage.cached_tokens)
        metrics.KEY_TOKENS.labels(self.name, "completion").inc(usage.completion_tokens)
        if prices is not None:
            metrics.KEY_COST.labels(self.name).inc(prices.cost(usage))


class ApiKeys:
    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic):
        """Reads `path` (ValueError if it is not a keys file)."""
        self.path = path
        self.clock = clock
        self._callers: dict[str, Caller] = {}  # by name: windows outlive a reload
        self._by_hash: dict[str, Caller] = {}
        self._mtime = os.stat(path).st_mtime_ns if os.path.exists(path) else None
        self._checked = clock()
        self._use(read_entries(path))

    def _use(self, entries: list[KeyEntry]) -> None:
        callers = {}
        for entry in entries:
            caller = self._callers.get(entry.name) or Caller(entry, self.clock)
            caller.entry = entry
            callers[entry.name] = caller
        self._callers = callers
        self._by_hash = {caller.entry.sha256: caller for caller in callers.values()}
        log.info(
            "API keys: %d (%s) from %s",
            len(callers),
            ", ".join(sorted(callers)) or "none",
            self.path,
        )

    def _reload_if_changed(self) -> None:
        now = self.clock()
        if now - self._checked < RELOAD_EVERY_S:
            return
        self._checked = now
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            mtime = None
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            self._use(read_entries(self.path))
        except ValueError as exc:
            log.warning("%s; keeping the %d keys read before", exc, len(self._callers))

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an `Authorization` value (`Bearer KEY`) names; UNAUTHENTICATED otherwise."""
        self._reload_if_changed()
        scheme, _, key = (authorization or "").strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            metrics.KEY_REJECTED.labels("", "no_key").inc()
            raise GatewayError(
                grpc.StatusCode.UNAUTHENTICATED,
                "no API key: send it as 'Authorization: Bearer KEY'",
            )
        caller = self._by_hash.get(key_hash(key))
        if caller is None:
            metrics.KEY_REJECTED.labels("", "wrong_key").inc()
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, "incorrect API key provided")
        return caller


def add_key(path: str, name: str, **fields) -> str:
    """Makes a key, stores its hash under `name` in `path` (created if missing) and returns it.
    `fields`: the key's other KeyEntry fields (limits, weight, scopes)."""
    entries = read_entries(path) if os.path.exists(path) else []
    if any(entry.name == name for entry in entries):
        raise ValueError(f"API keys file {path} already has a key named {name!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entries.append(KeyEntry(name, key_hash(key), **fields))
    defaults = KeyEntry("", "")
    keys = [
        {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in vars(e).items()
            if k in ("name", "sha256") or v != getattr(defaults, k)
        }
        for e in entries
    ]
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"keys": keys}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # a gateway reading the file sees the old one or the new one, whole
    return key


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.gateway.api_keys",
        description="make an API key and add its hash to a keys file",
    )
    parser.add_argument("file")
    parser.add_argument("name")
    parser.add_argument("--requests-per-minute", type=int, default=0)
    parser.add_argument("--tokens-per-minute", type=int, default=0)
    parser.add_argument("--max-concurrent-requests", type=int, default=0)
    parser.add_argument("--weight", type=int, default=1, help="turns in the queue (default 1)")
    parser.add_argument(
        "--scope", action="append", choices=SCOPES, default=[], help="metrics: may read /metrics"
    )
    args = parser.parse_args()
    if min(args.requests_per_minute, args.tokens_per_minute, args.max_concurrent_requests) < 0:
        parser.error("limits must not be negative")
    if args.weight < 1:
        parser.error("--weight must be at least 1")
    try:
        key = add_key(
            args.file,
            args.name,
            requests_per_minute=args.requests_per_minute,
            tokens_per_minute=args.tokens_per_minute,
            max_concurrent_requests=args.max_concurrent_requests,
            weight=args.weight,
            scopes=tuple(args.scope),
        )
    except ValueError as exc:
        sys.exit(str(exc))
    print(key)
    print(
        f"(added as {args.name!r} to {args.file}; the file keeps only its hash, so save the key now)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
