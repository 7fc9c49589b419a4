"""The workers the gateway can route to, kept current at run time.

Where the addresses come from (any mix):
- static lists per role (`--workers`, `--prefill`, `--decode`);
- a JSON file (`--workers-file`), `{"both": [...], "prefill": [...], "decode": [...]}`, which
  the launcher writes and anyone may rewrite: it is re-read whenever it changes;
- DNS: an entry `dns:NAME:PORT` stands for every address NAME resolves to (a Kubernetes
  headless Service), resolved again on every refresh.

A task on the gateway's event loop refreshes the set and polls each worker's Health every
`interval_s`: a worker that answers and is not draining is eligible, and reports its free KV blocks,
its batch size (`max_num_seqs`) and, for decode workers, the address prefill workers push KV to. A
call that finds a worker down marks it unhealthy at once, until its Health answers again; a draining
worker leaves routing at the poll that sees it. Each endpoint also counts what this gateway has in
flight on it: prompt tokens not yet prefilled, decode tokens (context + tokens still to
generate) of requests not yet finished, and the block hashes of the prompts in flight (blocks
it will hold once their prefill runs, before its KV events say so); the routing policies
(routing/) read these.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from services.gateway.shared_call import SharedCall
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")
HEALTH_TIMEOUT_S = 1.0


@dataclass(eq=False)  # compared by identity
class Endpoint:
    address: str
    role: str
    channel: grpc.aio.Channel = field(repr=False)
    healthy: bool = False
    draining: bool = False
    max_num_seqs: int = 0
    kv_store_namespace: str = ""  # with a KV store: the namespace of this worker's blocks there
    num_blocks: int = 0  # its KV pool, in blocks
    num_free_blocks: int = 0
    block_size: int = 16
    kv_address: str = ""
    in_flight_prefill_tokens: int = 0
    in_flight_decode_tokens: int = 0
    num_in_flight: int = 0
    num_routed: int = 0
    # block hash -> prompts in flight here that hold it
    in_flight_blocks: Counter = field(default_factory=Counter, repr=False)

    def __post_init__(self):
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.shared_call = SharedCall(self.worker)
        self.prefill = worker_pb2_grpc.PrefillStub(self.channel)
        self.decode = worker_pb2_grpc.DecodeStub(self.channel)

    @property
    def has_room(self) -> bool:
        """Fewer requests from this gateway than the worker's batch holds."""
        return self.num_in_flight < self.max_num_seqs

    def num_leading_in_flight(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks of `block_hashes` that a prompt in flight here shares (chained hashes:
        a shared block means a shared prefix up to it)."""
        n = 0
        while n < len(block_hashes) and self.in_flight_blocks[block_hashes[n]]:
            n += 1
        return n


class InFlight:
    """One request's load on one endpoint, counted from creation until `close` (or the end of a
    `with` block); `move_to_decode` when its prompt is done. Event-loop only: no locks.

    `decode_tokens_after_prefill`: what its decode will hold (prompt + max_tokens). A prompt
    with at most one block left to compute (the rest cached) is prefilled in the step that
    admits it and joins the running batch at once, so that load counts from creation, not from
    its first token: a burst sharing one cached prefix weighs on the holder while still queued.
    `block_hashes`: its prompt's, counted in `endpoint.in_flight_blocks` until `close`."""

    def __init__(
        self,
        endpoint: Endpoint,
        prefill_tokens: int,
        decode_tokens: int,
        decode_tokens_after_prefill: int = 0,
        block_hashes: Sequence[int] = (),
    ):
        self.endpoint = endpoint
        if prefill_tokens <= endpoint.block_size:
            decode_tokens += decode_tokens_after_prefill
        self.prefill_tokens, self.decode_tokens = prefill_tokens, decode_tokens
        self.block_hashes = block_hashes
        self.closed = False
        endpoint.num_in_flight += 1
        endpoint.num_routed += 1
        endpoint.in_flight_blocks.update(block_hashes)
        self._add(+1)

    def _add(self, sign: int) -> None:
        self.endpoint.in_flight_prefill_tokens += sign * self.prefill_tokens
        self.endpoint.in_flight_decode_tokens += sign * self.decode_tokens

    def move_to_decode(self, decode_tokens: int) -> None:
        self._add(-1)
        self.prefill_tokens, self.decode_tokens = 0, decode_tokens
        self._add(+1)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._add(-1)
            self.endpoint.num_in_flight -= 1
            counts = self.endpoint.in_flight_blocks
            for block_hash in self.block_hashes:
                counts[block_hash] -= 1
                if not counts[block_hash]:
                    del counts[block_hash]

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EndpointSet:
    def __init__(
        self,
        static: dict[str, list[str]],
        workers_file: str | None = None,
        interval_s: float = 0.5,
        on_join: Callable[[Endpoint], None] = lambda e: None,
        on_leave: Callable[[Endpoint], None] = lambda e: None,
        on_stopped_answering: Callable[[Endpoint], None] = lambda e: None,
    ):
        self.static = {role: list(static.get(role, ())) for role in ROLES}
        # The KV event feeds follow the set: a worker that leaves, or stops answering (a hung
        # worker's event stream may stay open), has its index entries dropped.
        self.on_join, self.on_leave, self.on_stopped_answering = (
            on_join,
            on_leave,
            on_stopped_answering,
        )
        self.workers_file = workers_file
        self.interval_s = interval_s
        self.on_change: Callable[[], None] = lambda: None  # after every refresh (admission wakes)
        self._file_mtime: tuple | None = None
        self._file_entries: dict[str, list[str]] = {role: [] for role in ROLES}
        self._endpoints: dict[tuple[str, str], Endpoint] = {}
        self._task: asyncio.Task | None = None

    # What callers read.

    def endpoints(self, role: str | None = None) -> list[Endpoint]:
        return [e for e in self._endpoints.values() if role is None or e.role == role]

    def eligible(self, role: str) -> list[Endpoint]:
        return [e for e in self.endpoints(role) if e.healthy and not e.draining]

    def has_role(self, role: str) -> bool:
        return bool(self.endpoints(role))

    def in_flight(
        self,
        endpoint: Endpoint,
        prefill_tokens: int = 0,
        decode_tokens: int = 0,
        decode_tokens_after_prefill: int = 0,
        block_hashes: Sequence[int] = (),
    ) -> InFlight:
        return InFlight(
            endpoint, prefill_tokens, decode_tokens, decode_tokens_after_prefill, block_hashes
        )

    def mark_down(self, endpoint: Endpoint) -> None:
        endpoint.healthy = False

    # Keeping the set current.

    async def start(self) -> None:
        """Refresh and poll once (so the first request finds workers), then keep doing it."""
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="endpoint-health")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # never let discovery die: the next round tries again
                log.exception("refreshing worker endpoints failed")

    async def refresh(self) -> None:
        wanted = set()
        for role in ROLES:
            wanted |= {(role, address) for address in await self._addresses(role)}
        current = set(self._endpoints)
        # A newcomer is polled before it joins, so it never shows up as unhealthy for a round.
        joining = [
            Endpoint(address, role, grpc.aio.insecure_channel(address))
            for role, address in wanted - current
        ]
        await asyncio.gather(*(self._poll(e) for e in list(self._endpoints.values()) + joining))
        for key in current - wanted:
            log.info("worker %s (%s) left the set", key[1], key[0])
            # Not closed here: that would cancel its requests in flight. The channel closes
            # when the last call holding the endpoint lets go of it.
            endpoint = self._endpoints.pop(key)
            endpoint.shared_call.retire()
            self.on_leave(endpoint)
        for endpoint in joining:
            log.info("worker %s (%s) joined the set", endpoint.address, endpoint.role)
            self._endpoints[(endpoint.role, endpoint.address)] = endpoint
            self.on_join(endpoint)
        self.on_change()

    async def _poll(self, endpoint: Endpoint) -> None:
        try:
            health = await endpoint.worker.Health(
                worker_pb2.HealthRequest(), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            if endpoint.healthy and (endpoint.role, endpoint.address) in self._endpoints:
                self.on_stopped_answering(endpoint)
            endpoint.healthy = False
            return
        endpoint.num_blocks = health.num_blocks
        endpoint.num_free_blocks = health.num_free_blocks
        endpoint.block_size = health.block_size or endpoint.block_size
        endpoint.kv_address = health.kv_address
        endpoint.max_num_seqs = health.max_num_seqs
        endpoint.kv_store_namespace = health.kv_store_namespace
        if health.draining and not endpoint.draining:
            log.info(
                "worker %s (%s) is draining; no new requests go there",
                endpoint.address,
                endpoint.role,
            )
        endpoint.draining = health.draining
        endpoint.healthy = health.role == endpoint.role and (
            endpoint.role != "decode" or bool(health.kv_address)
        )
        if health.role != endpoint.role:
            log.warning(
                "worker %s is a %s worker, listed as %s",
                endpoint.address,
                health.role,
                endpoint.role,
            )

    async def _addresses(self, role: str) -> list[str]:
        self._read_file()
        addresses = []
        for entry in self.static[role] + self._file_entries[role]:
            addresses += await _resolve(entry)
        return addresses

    def _read_file(self) -> None:
        if not self.workers_file:
            return
        try:
            stat = os.stat(self.workers_file)
            # a rename or same-tick rewrite shows too
            mtime = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
            if mtime == self._file_mtime:
                return
            with open(self.workers_file) as f:
                listed = json.load(f)
            self._file_entries = {role: [str(a) for a in listed.get(role, [])] for role in ROLES}
            self._file_mtime = mtime
        except (OSError, ValueError, AttributeError) as exc:
            log.warning(
                "cannot read workers file %s (keeping the last good list): %s",
                self.workers_file,
                exc,
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for endpoint in self._endpoints.values():
            endpoint.shared_call.close()
            await endpoint.channel.close()
        self._endpoints.clear()


async def _resolve(entry: str) -> list[str]:
    """`host:port` as is; `dns:NAME:PORT` as every address NAME resolves to (none if it doesn't)."""
    if not entry.startswith("dns:"):
        return [entry]
    name, _, port = entry[4:].rpartition(":")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            name, int(port), type=socket.SOCK_STREAM
        )
    except (socket.gaierror, ValueError):
        return []
    hosts = sorted({info[4][0] for info in infos})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]
