"""Public API requests to worker requests: validation, prompt tokens, sampling parameters."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import grpc
from google.protobuf import json_format

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from services.gateway.chat import render_prompt
from services.gateway.errors import GatewayError, invalid
from tandem.v1 import inference_pb2, worker_pb2


@dataclass
class ServedModel:
    """The model the workers run, as the gateway needs it: name, tokenizer, context length."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int

    @staticmethod
    def from_folder(folder: str) -> "ServedModel":
        return ServedModel(
            name=os.path.basename(os.path.normpath(folder)),
            tokenizer=Tokenizer(folder),
            max_model_len=ModelConfig.from_folder(folder).max_position_embeddings,
        )


def _value(msg, field: str):
    return json_format.MessageToDict(getattr(msg, field)) if msg.HasField(field) else None


def _stop_strings(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise invalid("stop must be a non-empty string or a list of up to 4 non-empty strings")
    return stops


def _sampling(req, prompt_len: int, model: ServedModel, max_tokens) -> worker_pb2.SamplingParams:
    room = model.max_model_len - prompt_len
    if room <= 0:
        raise invalid(f"the prompt has {prompt_len} tokens; the context is {model.max_model_len} tokens")
    if max_tokens is None:
        max_tokens = room
    elif max_tokens <= 0:
        raise invalid("max_tokens must be at least 1")
    elif max_tokens > room:
        raise invalid(f"max_tokens ({max_tokens}) + the prompt ({prompt_len} tokens) exceeds the context of "
                      f"{model.max_model_len} tokens; at most {room} fit")
    params = worker_pb2.SamplingParams(max_tokens=max_tokens, stop=_stop_strings(_value(req, "stop")),
                                       ignore_eos=getattr(req, "ignore_eos", False))
    for name in ("temperature", "top_p", "seed", "top_k", "min_p"):
        if req.HasField(name):
            setattr(params, name, getattr(req, name))
    return params


def _check_model(requested: str, model: ServedModel) -> None:
    if requested and requested != model.name:
        raise GatewayError(grpc.StatusCode.NOT_FOUND, f"model {requested!r} does not exist; this server has {model.name!r}")


def chat_request(req: inference_pb2.ChatCompletionRequest, model: ServedModel) -> tuple[worker_pb2.GenerateRequest, bool]:
    """The worker request, and whether to parse tool calls out of the reply."""
    _check_model(req.model, model)
    messages = [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in req.messages]
    tool_choice = _value(req, "tool_choice")
    use_tools = bool(req.tools) and tool_choice != "none"
    tools = [json_format.MessageToDict(t, preserving_proto_field_name=True) for t in req.tools] if use_tools else None
    prompt = model.tokenizer.encode(render_prompt(model.tokenizer, messages, tools))
    max_tokens = (req.max_completion_tokens if req.HasField("max_completion_tokens")
                  else req.max_tokens if req.HasField("max_tokens") else None)
    sampling = _sampling(req, len(prompt), model, max_tokens)
    sampling.logprobs = req.logprobs
    return worker_pb2.GenerateRequest(request_id=new_id("chatcmpl"), prompt_token_ids=prompt, sampling=sampling), use_tools


def completion_request(req: inference_pb2.CompletionRequest, model: ServedModel) -> worker_pb2.GenerateRequest:
    _check_model(req.model, model)
    if not req.prompt:
        raise invalid("prompt must not be empty")
    prompt = model.tokenizer.encode(req.prompt, add_special_tokens=True)
    sampling = _sampling(req, len(prompt), model, req.max_tokens if req.HasField("max_tokens") else None)
    return worker_pb2.GenerateRequest(request_id=new_id("cmpl"), prompt_token_ids=prompt, sampling=sampling)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
