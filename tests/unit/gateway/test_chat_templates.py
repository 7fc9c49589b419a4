"""Chat requests through a model's own template: chat_template_kwargs and reasoning_effort reach
it, history tool calls come as the template wants them (an object, or text for a template that
joins strings, as DeepSeek-V3.1's does), and Kimi's templates see Kimi's call ids."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.tokenizer import Tokenizer
from services.gateway.api.openai_models import ChatCompletionBody
from services.gateway.errors import GatewayError
from services.gateway.output.tool_formats import FORMATS
from services.gateway.prepare.chat import render_prompt

CALL = {
    "id": "call_abc",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
]


def with_template(chat_checkpoint, tmp_path, template: str) -> Tokenizer:
    folder = tmp_path / "m"
    shutil.copytree(chat_checkpoint, folder)
    (folder / "chat_template.jinja").write_text(template)
    return Tokenizer(str(folder))


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(chat_checkpoint, tmp_path):
    tok = with_template(
        chat_checkpoint, tmp_path, "{{ thinking }}/{{ enable_thinking }}/{{ extra | default('-') }}"
    )
    body = ChatCompletionBody(
        messages=[{"role": "user", "content": "hi"}],
        reasoning_effort="none",
        chat_template_kwargs={"extra": 7},
    )
    request = body.to_request()
    assert (
        render_prompt(tok, request.messages, None, request.reasoning, request.template_kwargs)
        == "False/False/7"
    )
    # kwargs win
    assert render_prompt(tok, request.messages, None, True, {"thinking": False}) == "False/True/-"
    with pytest.raises(GatewayError, match="chat_template_kwargs: messages cannot be set"):
        render_prompt(tok, request.messages, None, None, {"messages": []})


def test_history_arguments_are_an_object_or_text_as_the_template_uses_them(
    chat_checkpoint, tmp_path
):
    as_object = with_template(
        chat_checkpoint,
        tmp_path / "a",
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments.city }}{% endfor %}{% endfor %}",
    )
    assert render_prompt(as_object, HISTORY, None) == "Paris"
    joined = with_template(
        chat_checkpoint,
        tmp_path / "b",  # as DeepSeek-V3.1's template writes a past call
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ '<｜tool▁call▁begin｜>' + c.function.name + '<｜tool▁sep｜>' + c.function.arguments "
        "+ '<｜tool▁call▁end｜>' }}{% endfor %}{% endfor %}",
    )
    assert (
        render_prompt(joined, HISTORY, None)
        == '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
    )


def test_kimi_templates_see_kimi_s_call_ids(chat_checkpoint, tmp_path):
    tok = with_template(
        chat_checkpoint,
        tmp_path,
        "{% for m in messages %}{% for c in m.tool_calls or [] %}[{{ c.id }}]{% endfor %}"
        "{% if m.role == 'tool' %}<{{ m.tool_call_id }}>{% endif %}{% endfor %}",
    )
    second = {**CALL, "id": "call_def", "function": {"name": "get_time", "arguments": "{}"}}
    history = [
        *HISTORY,
        {"role": "assistant", "content": "", "tool_calls": [second]},
        {"role": "tool", "tool_call_id": "call_def", "content": "noon"},
    ]
    assert (
        render_prompt(tok, history, None, tool_format=FORMATS["kimi_k2"])
        == "[functions.get_weather:0]<functions.get_weather:0>[functions.get_time:1]<functions.get_time:1>"
    )
    assert render_prompt(tok, history, None) == "[call_abc]<call_abc>[call_def]<call_def>"
    # the request's own messages untouched
    assert json.loads(CALL["function"]["arguments"]) == {"city": "Paris"}


def test_history_reasoning_reaches_the_template_as_reasoning_content(chat_checkpoint, tmp_path):
    tok = with_template(
        chat_checkpoint, tmp_path, "{% for m in messages %}({{ m.reasoning_content }}){% endfor %}"
    )
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r1"},
        {"role": "assistant", "content": "b", "reasoning": "r2"},
    ]
    assert render_prompt(tok, history, None) == "()(r1)(r2)"


def test_chat_replies_carry_reasoning_content_and_its_tokens(chat_checkpoint):
    import asyncio

    from services.gateway.api.openai_api import ChatCompletions
    from services.gateway.prepare.requests import Prepared
    from services.gateway.protocol import Delta, Finish, Usage

    surface = ChatCompletions.__new__(ChatCompletions)
    surface.frontend = type("F", (), {"prices": None, "model": type("M", (), {"name": "m"})()})()
    body = ChatCompletionBody(
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    prepared = Prepared("chatcmpl-1", [None], 1, chat=True)
    usage = Usage(prompt_tokens=3, completion_tokens=6, reasoning_tokens=4)

    async def events():
        yield Delta(0, reasoning="thinking")
        yield Delta(0, reasoning=" hard", text="Hi")
        yield Finish(0, "stop", usage)

    async def run():
        unary = await surface.unary(prepared, body, events())
        return unary, [c async for c in surface.chunks(prepared, body, events())]

    unary, chunks = asyncio.run(run())
    message = unary["choices"][0]["message"]
    assert (
        message["content"] == "Hi"
        and message["reasoning_content"] == message["reasoning"] == "thinking hard"
    )
    assert unary["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "thinking hard"
    assert "".join(d.get("content", "") for d in deltas) == "Hi"
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
