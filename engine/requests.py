"""What the engine is asked to do: add a request, and where its prompt's KV comes from.

Plain data: a service builds these, the engine loop carries them to the engine thread, and
`LLMEngine.add` acts on them there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class Reservation:
    """Blocks set aside for KV arriving from elsewhere (`KVConnector.reserve`): the leading
    `num_cached` were found in this engine's prefix cache and already hold their KV; the rest
    are filled by a transport (`KVConnector.landing`) or a copy (`KVConnector.write`)."""

    blocks: list[int]
    num_cached: int = 0
    # A parallel engine's: the fresh blocks' bytes until `KVConnector.settle` scatters them to the ranks.
    staging: torch.Tensor | None = None

    @property
    def fresh_blocks(self) -> list[int]:
        return self.blocks[self.num_cached :]


@dataclass(frozen=True)
class FromPrefill:
    """The whole prompt's KV, computed by a prefill worker and landed in `reservation`, and the
    first token it sampled: the request joins the batch decoding."""

    reservation: Reservation
    first_token_id: int
    block_hashes: list[int] | None = None  # the sender's; when given, they must be the prompt's own


@dataclass(frozen=True)
class FromStore:
    """Leading blocks of the prompt loaded from the KV store into `reservation`: they join the
    prefix cache under `block_hashes` just before the request is queued, so nothing evicts them
    in between, and the request prefills only the rest."""

    reservation: Reservation
    block_hashes: list[int]


KVSource = FromPrefill | FromStore | None  # None: the engine computes the whole prompt


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv: KVSource = None
    # salts the prompt's block hashes (engine/block_hash.py): no prefix is shared across salts
    cache_salt: str = ""
