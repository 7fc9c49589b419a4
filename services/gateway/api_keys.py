"""API keys and per-key limits (`--api-keys-file`; `API_KEYS_FILE=` in `make run`).

The file is JSON and holds each key's SHA-256, never the key itself:

    {"keys": [{"name": "team-a", "sha256": "9f86d0...", "requests_per_minute": 60,
               "tokens_per_minute": 200000}]}

Limits are optional (absent or 0: none). `python -m services.gateway.api_keys FILE NAME
[--requests-per-minute N] [--tokens-per-minute N]` makes a key, adds its hash under NAME and
prints the key, once. The gateway re-reads the file when it changes (looking at most once a
second), so keys are added, limited or revoked without a restart; a file that no longer parses
keeps the keys read before, with a warning. Without the file every caller is served.

With keys, a call carries `Authorization: Bearer KEY` (gRPC: the `authorization` metadata,
which Envoy passes through from REST). A missing or unknown key is UNAUTHENTICATED (HTTP 401).
Each key's limits count over the last WINDOW_S seconds: requests as they are admitted, tokens
(prompt and completion) as they become known. A caller at either limit is RESOURCE_EXHAUSTED
(HTTP 429) with Retry-After: the seconds until enough of the window has passed. Usage is
counted per key name in metrics (metrics.py: `tandem:api_key_*`). No key reaches a log line,
a metric or an error message: only names do.
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


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyEntry:
    name: str
    sha256: str
    requests_per_minute: int = 0  # 0: no limit
    tokens_per_minute: int = 0


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
        for field in ("requests_per_minute", "tokens_per_minute"):
            value = item.get(field, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where} ({item['name']}): {field} must be a whole number >= 0")
            limits[field] = value
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

    @property
    def name(self) -> str:
        return self.entry.name

    def admit(self, prompt_tokens: int) -> None:
        """Counts a request and its prompt tokens, or raises RESOURCE_EXHAUSTED (with when to retry)."""
        now, entry = self.clock(), self.entry
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
        metrics.KEY_REQUESTS.labels(self.name).inc()

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


def add_key(path: str, name: str, requests_per_minute: int = 0, tokens_per_minute: int = 0) -> str:
    """Makes a key, stores its hash under `name` in `path` (created if missing) and returns it."""
    entries = read_entries(path) if os.path.exists(path) else []
    if any(entry.name == name for entry in entries):
        raise ValueError(f"API keys file {path} already has a key named {name!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    item = {"name": name, "sha256": key_hash(key)}
    if requests_per_minute:
        item["requests_per_minute"] = requests_per_minute
    if tokens_per_minute:
        item["tokens_per_minute"] = tokens_per_minute
    keys = [{k: v for k, v in vars(e).items() if v or k in ("name", "sha256")} for e in entries] + [
        item
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
    args = parser.parse_args()
    if min(args.requests_per_minute, args.tokens_per_minute) < 0:
        parser.error("limits must not be negative")
    try:
        key = add_key(args.file, args.name, args.requests_per_minute, args.tokens_per_minute)
    except ValueError as exc:
        sys.exit(str(exc))
    print(key)
    print(
        f"(added as {args.name!r} to {args.file}; the file keeps only its hash, so save the key now)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
