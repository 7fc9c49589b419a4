"""KV blocks in and out of parallel engines (real rank processes over gloo): a prefill engine of
one layout exports, a decode engine of another imports, and the tokens are one process's. The
exported blocks are in one whole engine's layout, whatever the parallelism."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.requests import AddRequest, FromPrefill
from engine.sampling_params import SamplingParams

PROMPTS = [list(range(40, 77)), [5, 17, 101, 33, 250, 7, 81], [3] * 16]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LAYOUTS = {"one": {}, "tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}


def engine(folder: str, role: str, layout: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=folder, dtype="float32", kv_cache_bytes=4 << 20, role=role, **LAYOUTS[layout]
        )
    )


def disaggregated(folder: str, prefill_layout: str, decode_layout: str):
    """(greedy tokens, exported KV per prompt) through a prefill and then a decode engine (one
    after the other: a process holds one parallel group at a time)."""
    prefill = engine(folder, "prefill", prefill_layout)
    try:
        for i, prompt in enumerate(PROMPTS):
            prefill.add_request(f"r{i}", prompt, GREEDY)
        prefilled = {}
        while prefill.has_unfinished_requests():
            prefilled.update((out.request_id, out.kv) for out in prefill.step())
        exported = []
        for i in range(len(PROMPTS)):
            exported.append(prefilled[f"r{i}"])
            prefill.abort(f"r{i}")
    finally:
        prefill.close()
    decode = engine(folder, "decode", decode_layout)
    try:
        tokens = {}
        for kv in exported:
            reservation = decode.kv.reserve(kv.data.shape[1])
            decode.kv.write(reservation, kv.data)
            first = decode.add(
                AddRequest(
                    kv.request_id,
                    kv.prompt_token_ids,
                    GREEDY,
                    FromPrefill(reservation, kv.first_token_id, kv.block_hashes),
                )
            )
            tokens[kv.request_id] = list(first.new_token_ids)
        while decode.has_unfinished_requests():
            for out in decode.step():
                tokens[out.request_id] += out.new_token_ids
        assert decode.num_free_blocks == decode.num_blocks
        return [tokens[f"r{i}"] for i in range(len(PROMPTS))], [kv.data for kv in exported]
    finally:
        decode.close()


def prompt_kv(data: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The prompt's tokens of exported blocks [layers, blocks, entries, block_size, heads, head_dim]
    (the last block's other slots hold whatever the pool had there)."""
    layers, blocks, entries, block_size, heads, head_dim = data.shape
    return data.transpose(1, 2).reshape(layers, entries, blocks * block_size, heads, head_dim)[
        :, :, :num_tokens
    ]


@pytest.mark.parametrize(
    "arch, prefill_layout, decode_layout",
    [
        ("llama", "tp2", "one"),
        ("llama", "one", "tp2"),
        ("llama", "pp2", "tp2"),
        ("deepseek_v3", "tp2", "pp2"),
    ],
)
def test_kv_moves_between_layouts(hf_checkpoint, arch, prefill_layout, decode_layout):
    folder = hf_checkpoint(arch)[1]
    colocated = [
        c.token_ids
        for c in LLMEngine(
            EngineConfig(model=folder, dtype="float32", kv_cache_bytes=4 << 20)
        ).generate(PROMPTS, GREEDY)
    ]
    _, single = disaggregated(folder, "one", "one")
    tokens, exported = disaggregated(folder, prefill_layout, decode_layout)
    assert tokens == colocated
    for prompt, data, reference in zip(
        PROMPTS, exported, single
    ):  # gathered: a single engine's blocks
        assert data.shape == reference.shape
        torch.testing.assert_close(
            prompt_kv(data, len(prompt)), prompt_kv(reference, len(prompt)), rtol=1e-4, atol=1e-4
        )
