"""The transport contract, and the header that travels ahead of each transfer.

One transfer, on any transport:
1. sender -> receiver: the header (JSON): request id, payload size, block hashes, first token.
2. receiver -> sender: accept or refuse. To accept, the receiver's `on_header` returns the
   writable segments the payload fills, in order: a decode worker returns views of the KV
   blocks it reserved, one per layer and run of adjacent block ids, so the bytes land
   straight in its pool. It may also name `skip_blocks`, leading blocks it already holds
   (its own prefix cache): the sender then leaves them out of the payload, which is
   [layers, blocks - skip_blocks, ...]. To refuse it raises TransferRefused (no room, bad
   header). The accept names `skip_blocks` and the segments' sizes (a message-based
   transport sends one message per segment).
3. sender -> receiver: the payload, straight into those segments.
4. receiver -> sender: an ack once every byte has landed.

Every step runs under the sender's deadline. The receiver calls `on_done(header, ok)` exactly
once for every accepted transfer, with ok=False when the sender died, stalled past the
deadline or sent a short payload, so the receiver can free what it reserved.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np


class TransferError(Exception):
    """A transfer did not complete: peer down, refused, or past its deadline."""


class TransferRefused(TransferError):
    """The receiver would not take the transfer (raised by `on_header`, seen by the sender)."""


@dataclass
class TransferHeader:
    request_id: str
    nbytes: int
    deadline_s: float  # how long the receiver waits for the payload before giving up
    # [layers, blocks, 2, block_size, kv_heads, head_dim]
    shape: list[int] = field(default_factory=list)
    dtype: str = ""
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks, in order
    first_token_id: int = -1
    num_cached_tokens: int = 0
    namespace: str = ""  # KV store transfers: the blocks' namespace (services/kvcache/keys.py)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes) -> TransferHeader:
        try:
            fields = json.loads(raw)
            header = TransferHeader(**fields)
        except (ValueError, TypeError) as exc:
            raise TransferRefused(f"malformed transfer header: {exc}") from None
        if header.nbytes < 0 or header.deadline_s <= 0:
            raise TransferRefused("transfer header has a negative size or no deadline")
        return header


@dataclass
class Accepted:
    segments: list[np.ndarray]  # flat uint8, in payload order
    skip_blocks: int = 0  # leading blocks the receiver holds already: not sent


OnHeader = Callable[[TransferHeader], Accepted]
# The payload to send once the receiver has said how many leading blocks to skip.
Payload = Callable[[int], np.ndarray]
OnDone = Callable[[TransferHeader, bool], None]


class KVReceiver(ABC):
    """Accepts transfers from any number of senders at once."""

    def __init__(self, on_header: OnHeader, on_done: OnDone):
        self.on_header = on_header
        self.on_done = on_done

    @abstractmethod
    def start(self, host: str) -> str:
        """Listen on `host` (any free port); returns the address senders use (`scheme://host:port`)."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening; transfers in flight fail (and get `on_done(..., False)`)."""


class KVSender(ABC):
    @abstractmethod
    def send(
        self, host_port: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> int:
        """Blocks until the receiver acks every byte; returns the bytes sent. Raises
        TransferRefused or TransferError (after at most `timeout_s`); the receiver frees its
        side on its own."""

    @abstractmethod
    def close(self) -> None: ...


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view (no copy) of a contiguous array."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
