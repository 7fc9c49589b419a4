"""A request's events gathered into whole choices: what every unary reply is made of (OpenAI's
chat completions and completions, the Responses API, Anthropic's Messages)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.gateway.output.tool_calls import ToolCall
from services.gateway.protocol import Delta, Event, Finish, TokenLogprob


class Reply:
    """One choice, whole: its text, reasoning, finished tool calls and logprobs, and its Finish
    (None until it has one)."""

    def __init__(self):
        self._texts: list[str] = []
        self._thoughts: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish: Finish | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, Delta):
            self._texts.append(event.text)
            self._thoughts.append(event.reasoning)
            self.calls += event.tool_calls
            self.logprobs += event.logprobs
        else:
            self.finish = event

    @property
    def text(self) -> str:
        return "".join(self._texts)

    @property
    def reasoning(self) -> str:
        return "".join(self._thoughts)


async def replies(events: AsyncIterator[Event], num_choices: int) -> list[Reply]:
    """Every choice of a request whole, in choice order."""
    choices = [Reply() for _ in range(num_choices)]
    async for event in events:
        choices[event.index].add(event)
    return choices


async def one_reply(events: AsyncIterator[Event]) -> Reply:
    """A one-choice request's whole reply."""
    return (await replies(events, 1))[0]
