"""The Worker API's messages to and from the gateway's own types (protocol.py): a generation's
sampling options out, a Generate or Decode response and a Prefill's first token in as token
chunks. worker_pool.py makes the calls."""

from __future__ import annotations

from services.gateway.protocol import GenerationRequest, TokenChunk
from tandem.v1 import worker_pb2

FINISH_REASONS = {
    worker_pb2.FINISH_REASON_STOP: "stop",
    worker_pb2.FINISH_REASON_LENGTH: "length",
    worker_pb2.FINISH_REASON_ABORT: "abort",
}


def sampling_message(request: GenerationRequest) -> worker_pb2.SamplingParams:
    options = request.sampling
    msg = worker_pb2.SamplingParams(
        max_tokens=options.max_tokens,
        top_k=options.top_k,
        min_p=options.min_p,
        stop=options.stop,
        ignore_eos=options.ignore_eos,
        logprobs=options.logprobs or options.top_logprobs > 0,
        top_logprobs=options.top_logprobs,
        prediction_token_ids=request.prediction_token_ids,
        grammar=options.grammar,
    )
    for name in ("temperature", "top_p", "seed"):
        if getattr(options, name) is not None:
            setattr(msg, name, getattr(options, name))
    return msg


def store_tokens(response) -> dict[str, int]:
    """A Generate or Prefill response's prompt tokens loaded from the KV store, by tier."""
    tiers = response.store_tokens
    return {
        "dram": tiers.dram,
        "disk": tiers.disk,
        "mooncake": tiers.mooncake,
        "mooncake_disk": tiers.mooncake_disk,
    }


def token_chunk(response: worker_pb2.GenerateResponse) -> TokenChunk:
    return TokenChunk(
        token_ids=list(response.token_ids),
        logprobs=list(response.logprobs),
        top_logprobs=[list(zip(t.token_ids, t.logprobs)) for t in response.top_logprobs],
        finish_reason=FINISH_REASONS.get(response.finish_reason),
        num_prompt_tokens=response.num_prompt_tokens,
        num_cached_tokens=response.num_cached_tokens,
        store_tokens=store_tokens(response),
        stop_string=response.stop_string,
        num_draft_tokens=response.num_draft_tokens,
        num_accepted_draft_tokens=response.num_accepted_draft_tokens,
    )


def prefill_chunk(response: worker_pb2.PrefillResponse) -> TokenChunk:
    """A Prefill response's first token, as the stream's first chunk."""
    return TokenChunk(
        token_ids=[response.first_token_id],
        logprobs=list(response.logprobs),
        top_logprobs=[list(zip(response.top_logprobs.token_ids, response.top_logprobs.logprobs))]
        if response.HasField("top_logprobs")
        else [],
        finish_reason=FINISH_REASONS.get(response.finish_reason),
        num_prompt_tokens=response.num_prompt_tokens,
        num_cached_tokens=response.num_cached_tokens,
        store_tokens=store_tokens(response),
        stop_string=response.stop_string,
    )
