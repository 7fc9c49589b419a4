"""`python -m services.draft --model TARGET --draft-model DRAFT`: the draft service. DRAFT is a
draft model or an EAGLE-3 head (which also reads the target's embedding table from TARGET).
Prints `draft ready on HOST:PORT`, or `draft failed to start: <cause>`. Serves grpc.health.v1."""

from __future__ import annotations

from engine.checkpoint import Checkpoint
from engine.config import ModelConfig
from engine.device import resolve_device, resolve_dtype
from engine.kv_cache import bytes_per_block
from engine.speculative.base import Drafter
from engine.speculative.draft_model import DraftModelDrafter
from engine.speculative.eagle3 import Eagle3Drafter, is_eagle3_head, load_head
from services import lifecycle
from services.draft.config import DraftConfig
from services.draft.servicer import DraftServicer
from tandem.v1 import draft_pb2_grpc

BLOCK_SIZE = 16


def load_drafter(config: DraftConfig) -> Drafter:
    target = ModelConfig.from_folder(config.model)
    device = resolve_device("auto")
    if is_eagle3_head(config.draft_model):
        dtype = resolve_dtype(config.dtype, target, device)
        head = load_head(config.draft_model, target)[0]
        num_blocks = max(1, config.kv_cache_bytes // bytes_per_block(head, BLOCK_SIZE, dtype))
        # a view of the mmap: no copy
        embed = Checkpoint(config.model, target.weight_prefix).weights["model.embed_tokens.weight"]
        return Eagle3Drafter(
            config.draft_model,
            target,
            embed,
            num_blocks,
            BLOCK_SIZE,
            target.max_position_embeddings,
            dtype,
            device,
        )
    draft = ModelConfig.from_folder(config.draft_model)
    dtype = resolve_dtype(config.dtype, draft, device)
    num_blocks = max(1, config.kv_cache_bytes // bytes_per_block(draft, BLOCK_SIZE, dtype))
    return DraftModelDrafter(
        config.draft_model,
        target.vocab_size,
        num_blocks,
        BLOCK_SIZE,
        target.max_position_embeddings,
        dtype,
        device,
    )


async def serve(config: DraftConfig) -> None:
    try:
        drafter = load_drafter(config)
        service = lifecycle.GrpcService("draft", config.host, config.port)
        draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(drafter), service.server)
        service.bind()
    except Exception as exc:
        lifecycle.fail_start("draft", exc)
    await service.start()
    await service.stopped()
    await service.stop()


def main() -> None:
    lifecycle.run("draft", DraftConfig.from_args, serve)


if __name__ == "__main__":
    main()
