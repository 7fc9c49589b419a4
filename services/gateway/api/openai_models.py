"""OpenAI request bodies as pydantic models, converted to the gateway's own types.

Unknown fields are refused (400), as OpenAI's API refuses them, so a client never believes
a setting took effect when it did not. Known OpenAI parameters tandem does not implement are
accepted only at their neutral value (`frequency_penalty: 0`, `logit_bias: {}`, ...);
any other value gets a 400 naming the parameter. `user` and `parallel_tool_calls` are
accepted and have no effect (every tool call in a reply is parsed). vLLM's extensions
`top_k`, `min_p`, `ignore_eos`, `repetition_penalty: 1`, `chat_template_kwargs` and
`cache_salt` are accepted too; `reasoning_effort` switches the model's thinking (off at "none").
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.prepare.requests import prediction_text
from services.gateway.protocol import ChatRequest, CompletionRequest, SamplingOptions

# name -> the only value tandem accepts (what the parameter does when left out)
NEUTRAL = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "functions": ([],),
    "function_call": ("none",),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Accepted at their neutral value only (see NEUTRAL).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # Predicted Outputs (checked by requests.prediction_text)
    prediction: dict[str, Any] | None = None
    # vLLM's: the prompt's cached prefix is shared only with requests of the same salt (and
    # API key: prepare/requests.py key_salted)
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _neutral_only(self):
        for name, accepted in NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value not in accepted:
                raise ValueError(
                    f"{name}={value!r} is not supported by this server "
                    f"(leave it out, or set it to {accepted[0]!r})"
                )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _options(
        self, max_tokens: int | None, logprobs: bool, top_logprobs: int
    ) -> SamplingOptions:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prediction=prediction_text(self.prediction),
        )


class ChatCompletionBody(_Body):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's: variables for the template (thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: "none" turns the model's thinking off, any other on
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def to_request(self, session: str = "") -> ChatRequest:
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return ChatRequest(
            messages=self.messages,
            options=self._options(max_tokens, self.logprobs, self.top_logprobs or 0),
            model=self.model,
            tools=self.tools,
            tool_choice=self.tool_choice,
            n=self.n,
            session=session,
            response_format=self.response_format,
            template_kwargs=self.chat_template_kwargs,
            cache_salt=self.cache_salt or "",
            reasoning=None if self.reasoning_effort is None else self.reasoning_effort != "none",
            reasoning_effort=self.reasoning_effort or "",
        )


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    # top alternatives per token, as OpenAI's legacy API
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def to_request(self, session: str = "") -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        logprobs = self.logprobs is not None
        return CompletionRequest(
            prompts=prompts,
            options=self._options(self.max_tokens, logprobs, self.logprobs or 0),
            model=self.model,
            n=self.n,
            session=session,
            cache_salt=self.cache_salt or "",
        )
