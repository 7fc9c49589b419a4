"""Reasoning out of model text, as it streams: what the model thinks before it answers.

The families write it between `<think>` and `</think>` (vLLM's parser names):
- deepseek_r1 (DeepSeek-R1, V3.1 in thinking mode), qwen3: `<think>...</think>` then the
  answer. Where the chat template pre-fills `<think>` (R1, V3.1), the output starts inside.
- kimi_k2 (K2-Thinking, K2.5): the template pre-fills `<think>`, and reasoning also ends where
  a tool-call section begins without `</think>`.
- openai_gptoss (gpt-oss): harmony's `analysis` channel, read token by token with openai-harmony
  (output/harmony.py); `ReasoningParser` never reads it.

Whether the output starts inside reasoning is read off the rendered prompt (it ends with the
opening tag), so one parser serves a template in either mode (Qwen3's enable_thinking false
pre-fills an empty `<think></think>`: the output then starts outside). Otherwise reasoning is
recognised only at the very start of the output. `ReasoningParser.feed` returns (reasoning,
content) safe to show now; text that may be the start of a tag is held back until it is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.output.harmony import REASONING_FORMAT as HARMONY_FORMAT
from services.gateway.output.tool_calls import partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    also_ends_at: tuple[str, ...] = ()  # markers that end reasoning and stay in the content

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end, *self.also_ends_at)


FORMATS = {
    f.name: f
    for f in (
        ReasoningFormat("deepseek_r1"),
        ReasoningFormat("qwen3"),
        ReasoningFormat("kimi_k2", also_ends_at=("<|tool_calls_section_begin|>",)),
        ReasoningFormat(HARMONY_FORMAT, "<|channel|>analysis<|message|>", "<|end|>"),
    )
}


def detect(template: str | None, model_type: str = "", name: str = "") -> ReasoningFormat | None:
    """`name` (--reasoning-parser; "none": no parsing) if given; else from the template's markup."""
    if name:
        if name == "none":
            return None
        if name not in FORMATS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; choose from none, {', '.join(FORMATS)}"
            )
        return FORMATS[name]
    if model_type == "gpt_oss" or "<|channel|>" in (template or ""):
        return FORMATS[HARMONY_FORMAT]
    if "<think>" not in (template or ""):
        return None
    if "<|tool_calls_section_begin|>" in template or model_type in ("kimi_k2", "kimi_k25"):
        return FORMATS["kimi_k2"]
    return FORMATS["deepseek_r1" if "<｜" in template else "qwen3"]


def starts_inside(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """The rendered prompt ends in an open reasoning tag (the template pre-filled it)."""
    at = prompt_tail.rfind(fmt.start)
    return at >= 0 and not prompt_tail[at + len(fmt.start) :].strip()


class ReasoningParser:
    BEFORE, REASONING, CONTENT = range(3)

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        self.state = self.REASONING if inside else self.BEFORE
        self.buffer = ""
        self.reasoning = ""  # all of it so far (usage counts its tokens)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        fmt = self.fmt
        if self.state == self.BEFORE:
            stripped = self.buffer.lstrip()
            if stripped and fmt.start.startswith(stripped) and stripped != fmt.start:
                return "", ""  # may still become the opening tag
            if stripped.startswith(fmt.start):
                self.buffer, self.state = stripped[len(fmt.start) :], self.REASONING
            else:
                self.state = self.CONTENT
        if self.state == self.REASONING:
            ends = [(self.buffer.find(m), m) for m in (fmt.end, *fmt.also_ends_at)]
            at, marker = min(((i, m) for i, m in ends if i >= 0), default=(-1, ""))
            if at < 0:
                keep = partial_suffix(self.buffer, (fmt.end, *fmt.also_ends_at))
                reasoning, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
            else:
                reasoning = self.buffer[:at]
                self.buffer = (
                    self.buffer[at + len(marker) :] if marker == fmt.end else self.buffer[at:]
                )
                self.state = self.CONTENT
        if self.state == self.CONTENT:
            content, self.buffer = self.buffer, ""
        self.reasoning += reasoning
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of the stream: what was held back, in the channel it was in."""
        rest, self.buffer = self.buffer, ""
        if self.state == self.REASONING:
            self.reasoning += rest
            return rest, ""
        return "", rest
