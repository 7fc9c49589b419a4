"""Protobuf <-> engine types, at the worker's edge only."""

from __future__ import annotations

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tandem.v1 import worker_pb2

FINISH_REASONS = {
    None: worker_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": worker_pb2.FINISH_REASON_STOP,
    "length": worker_pb2.FINISH_REASON_LENGTH,
    "abort": worker_pb2.FINISH_REASON_ABORT,
}


def sampling_params(msg: worker_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError for values the engine refuses."""
    return SamplingParams(
        max_tokens=msg.max_tokens or 16,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        prediction=tuple(msg.prediction_token_ids),
        grammar=msg.grammar,
    )


def top_logprobs(pairs: list[tuple[int, float]]) -> worker_pb2.TopLogprobs:
    return worker_pb2.TopLogprobs(token_ids=[t for t, _ in pairs], logprobs=[p for _, p in pairs])


def generate_response(
    out: RequestOutput, store_tokens: worker_pb2.StoreTokens | None = None
) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        token_ids=out.new_token_ids,
        logprobs=[
            0.0 if p is None else p for p in out.new_logprobs or ()
        ],  # None: computed elsewhere
        finish_reason=FINISH_REASONS[out.finish_reason],
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        stop_string=out.stop_reason if isinstance(out.stop_reason, str) else "",
        top_logprobs=[top_logprobs(pairs) for pairs in out.new_top_logprobs or ()],
        num_draft_tokens=out.num_draft_tokens,
        num_accepted_draft_tokens=out.num_accepted_draft_tokens,
        store_tokens=store_tokens,
    )
