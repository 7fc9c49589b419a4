"""Public requests to generation requests: validation, chat template, prompt tokens, max_tokens.

A chat request is one prompt; a completion request may carry several (text or token ids).
Each prompt becomes `n` generation requests, one per choice, numbered prompt-major (choice
index = prompt index * n + i), as OpenAI numbers them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from services.gateway.errors import ContextLimit, GatewayError, invalid
from services.gateway.output import reasoning, tool_formats
from services.gateway.output.harmony import speaks_harmony
from services.gateway.output.reasoning import ReasoningFormat
from services.gateway.output.tool_calls import CallFormat
from services.gateway.output.tool_formats import HERMES
from services.gateway.prepare import harmony
from services.gateway.prepare.chat import render_prompt
from services.gateway.prepare.structured import chat_grammar
from services.gateway.protocol import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    SamplingOptions,
)

MAX_N = 128  # choices per request
SESSION_HEADER = "x-session-affinity"
MAX_STOPS = 4


@dataclass
class ServedModel:
    """The model the workers run, as the gateway needs it: name, tokenizer, context length, and the
    markup its tool calls come in."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    tool_format: CallFormat = HERMES
    reasoning_format: ReasoningFormat | None = None

    @property
    def harmony(self) -> bool:
        """Its chat format is harmony (gpt-oss): rendered and read by openai-harmony."""
        return speaks_harmony(self.tool_format, self.reasoning_format)

    @staticmethod
    def from_folder(
        folder: str,
        tool_call_parser: str = "",
        reasoning_parser: str = "",
        trust_remote_code: bool = False,
    ) -> ServedModel:
        config = ModelConfig.from_folder(folder)
        tokenizer = Tokenizer(folder, trust_remote_code)
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
        # as published: kimi_k2, not deepseek_v3
        model_type = (raw.get("text_config") or raw).get("model_type", "")
        return ServedModel(
            name=os.path.basename(os.path.normpath(folder)),
            tokenizer=tokenizer,
            max_model_len=config.max_position_embeddings,
            vocab_size=config.vocab_size,
            tool_format=tool_formats.detect(tokenizer.chat_template, model_type, tool_call_parser),
            reasoning_format=reasoning.detect(
                tokenizer.chat_template, model_type, reasoning_parser
            ),
        )


@dataclass
class Prepared:
    """What the gateway runs for one public request."""

    request_id: str
    generations: list[GenerationRequest]  # in choice order
    n: int
    # the markup tool calls are parsed out of (None: no tools)
    tool_format: CallFormat | None = None
    chat: bool = False  # a chat turn: reasoning is parsed out of the text (output/reasoning.py)
    warning: str = ""  # sent as the x-tandem-warning header (what of the request was left out)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prediction_text(prediction: Any) -> str:
    """OpenAI's `prediction` ({"type": "content", "content": a string or text parts}) as text;
    "" when there is none."""
    if prediction is None:
        return ""
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise invalid('prediction must be {"type": "content", "content": ...}')
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(
        'prediction.content must be a string or a list of {"type": "text", "text": ...} parts'
    )


def check_model(model: ServedModel, requested: str) -> None:
    if requested and requested != model.name:
        raise GatewayError(
            grpc.StatusCode.NOT_FOUND,
            f"model {requested!r} does not exist; this server has {model.name!r}",
            field="model",
        )


def _check_common(model: ServedModel, requested: str, options: SamplingOptions, n: int) -> None:
    check_model(model, requested)
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, not {n}")
    if len(options.stop) > MAX_STOPS or not all(options.stop):
        raise invalid(
            f"stop must be a non-empty string or a list of up to {MAX_STOPS} non-empty strings"
        )
    if not 0 <= options.top_logprobs <= 20:
        raise invalid(f"top_logprobs must be between 0 and 20, not {options.top_logprobs}")


def _max_tokens(
    options: SamplingOptions, prompt_len: int, model: ServedModel, default: int = 0
) -> int:
    """`default`: the cap without max_tokens (0: the whole rest of the context)."""
    room = model.max_model_len - prompt_len
    if room <= 0:
        raise ContextLimit(
            prompt_len,
            None,
            model.max_model_len,
            f"the prompt has {prompt_len} tokens; the context is {model.max_model_len} tokens",
        )
    if options.max_tokens is None:
        return min(room, default) if default else room
    if options.max_tokens <= 0:
        raise invalid("max_tokens must be at least 1")
    if options.max_tokens > room:
        raise ContextLimit(
            prompt_len,
            options.max_tokens,
            model.max_model_len,
            f"max_tokens ({options.max_tokens}) + the prompt ({prompt_len} tokens) exceeds the context "
            f"of {model.max_model_len} tokens; at most {room} fit",
        )
    return options.max_tokens


def _generations(
    request_id: str,
    prompts: list[list[int]],
    options: SamplingOptions,
    n: int,
    model: ServedModel,
    session: str,
    default_max_tokens: int = 0,
    cache_salt: str = "",
) -> list[GenerationRequest]:
    generations = []
    prediction = model.tokenizer.encode(options.prediction) if options.prediction else []
    for p, prompt in enumerate(prompts):
        sampling = dataclasses.replace(
            options, max_tokens=_max_tokens(options, len(prompt), model, default_max_tokens)
        )
        for i in range(n):
            seed = (
                sampling
                if sampling.seed is None or i == 0
                else dataclasses.replace(sampling, seed=sampling.seed + i)
            )
            generations.append(
                GenerationRequest(
                    f"{request_id}-{p * n + i}", prompt, seed, session, prediction, cache_salt
                )
            )
    return generations


def chat_prompt(req: ChatRequest, model: ServedModel) -> list[int]:
    """The prompt's token ids: the messages (and tools, unless tool_choice is none) through the
    model's template."""
    use_tools = bool(req.tools) and req.tool_choice != "none"
    if model.harmony:
        return harmony.render(
            req.messages,
            req.tools if use_tools else None,
            req.reasoning_effort,
            req.reasoning,
            req.template_kwargs,
        )
    text = render_prompt(
        model.tokenizer,
        req.messages,
        req.tools if use_tools else None,
        req.reasoning,
        req.template_kwargs,
        model.tool_format,
    )
    return model.tokenizer.encode(text)


def chat(
    req: ChatRequest, model: ServedModel, id_prefix: str = "chatcmpl", default_max_tokens: int = 0
) -> Prepared:
    """`id_prefix`: the public API's id (chatcmpl, resp, msg); `default_max_tokens`: the cap
    without max_tokens (0: the rest of the context)."""
    _check_common(model, req.model, req.options, req.n)
    use_tools = bool(req.tools) and req.tool_choice != "none"
    past_calls = sum(len(m.get("tool_calls") or []) for m in req.messages)
    grammar, tool_format = chat_grammar(
        req.response_format,
        req.tools,
        req.tool_choice,
        model.tokenizer,
        model.tool_format,
        past_calls,
    )
    prompt = chat_prompt(req, model)
    request_id = new_id(id_prefix)
    options = dataclasses.replace(req.options, grammar=grammar) if grammar else req.options
    tool_format = tool_format if use_tools else None
    return Prepared(
        request_id,
        _generations(
            request_id,
            [prompt],
            options,
            req.n,
            model,
            req.session,
            default_max_tokens,
            req.cache_salt,
        ),
        req.n,
        tool_format,
        chat=True,
    )


def completion(req: CompletionRequest, model: ServedModel) -> Prepared:
    _check_common(model, req.model, req.options, req.n)
    if not req.prompts:
        raise invalid("prompt must not be empty")
    prompts = []
    for i, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            if not prompt:
                raise invalid("prompt must not be empty")
            prompts.append(model.tokenizer.encode(prompt, add_special_tokens=True))
            continue
        if not prompt:
            raise invalid(f"prompt {i} has no token ids")
        bad = next((t for t in prompt if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise invalid(
                f"prompt {i}: token id {bad} is outside the vocabulary [0, {model.vocab_size})"
            )
        prompts.append(list(prompt))
    request_id = new_id("cmpl")
    generations = _generations(
        request_id, prompts, req.options, req.n, model, req.session, cache_salt=req.cache_salt
    )
    return Prepared(request_id, generations, req.n)


def key_salted(prepared: Prepared, key_salt: str) -> Prepared:
    """`prepared` under its API key's cache salt: each generation's salt becomes the key's and
    the request's together, so a request's own `cache_salt` never reaches another key's
    cache (the key's salt is length-prefixed: no request salt can spell another key's)."""
    prepared.generations = [
        dataclasses.replace(g, cache_salt=f"key:{len(key_salt)}:{key_salt}:{g.cache_salt}")
        for g in prepared.generations
    ]
    return prepared
