"""Chat requests to gpt-oss's prompt in harmony, rendered by openai-harmony (its chat template
is not used): the token ids come from openai-harmony itself.

- system: openai-harmony's system message (model identity, knowledge cutoff, the channels
  analysis, commentary and final) with `Reasoning: low|medium|high` from the request's effort
  (chat's reasoning_effort, Responses' reasoning.effort, Messages' output_config.effort, or
  chat_template_kwargs' reasoning_effort as gpt-oss's template reads it; none and minimal are
  low, xhigh and max high; thinking switched off is low, since gpt-oss always reasons; medium
  when none is given). No current date: a request renders the same tokens on any day.
- developer: the leading system messages' text (the other APIs' developer messages and
  instructions arrive as such) as `# Instructions`, and the
  function tools (`namespace functions`); a system message further on becomes a developer
  message where it stands.
- assistant: its reasoning on analysis; its text on final, or on commentary (a preamble) where
  calls follow; each call on commentary to `functions.NAME`, `<|constrain|>json`, its arguments
  as the client sent them back (the model's own text).
- tool: `functions.NAME to=assistant` on commentary, NAME from the call its id answers.
- Previous turns' analysis is dropped as openai-harmony drops it (analysis before the last
  final message); a turn still making its tool calls keeps its own.
"""

from __future__ import annotations

import json

from services.gateway.errors import invalid
from services.gateway.prepare.chat import normalize_messages

EFFORTS = {
    "none": "LOW",
    "minimal": "LOW",
    "low": "LOW",
    "medium": "MEDIUM",
    "high": "HIGH",
    "xhigh": "HIGH",
    "max": "HIGH",
}


def _effort(effort: str, reasoning: bool | None):
    from openai_harmony import ReasoningEffort

    if not effort:
        return ReasoningEffort.LOW if reasoning is False else ReasoningEffort.MEDIUM
    if effort not in EFFORTS:
        raise invalid(f"reasoning effort must be one of {', '.join(EFFORTS)}, not {effort!r}")
    return ReasoningEffort[EFFORTS[effort]]


def _arguments(call: dict) -> str:
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments or {}, ensure_ascii=False)


def _assistant(message: dict, raw: dict) -> list:
    from openai_harmony import Message, Role

    out = []
    if message.get("reasoning_content"):
        out.append(
            Message.from_role_and_content(
                Role.ASSISTANT, message["reasoning_content"]
            ).with_channel("analysis")
        )
    calls = raw.get("tool_calls") or []
    if message["content"]:
        channel = "commentary" if calls else "final"
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, message["content"]).with_channel(channel)
        )
    for call in calls:
        name = (call.get("function") or {}).get("name", "")
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, _arguments(call))
            .with_channel("commentary")
            .with_recipient(f"functions.{name}")
            .with_content_type("<|constrain|>json")
        )
    return out


def _developer(instructions: list[str], tools: list[dict] | None):
    from openai_harmony import DeveloperContent, Message, Role, ToolDescription

    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions("\n\n".join(instructions))
    functions = [
        t.get("function") or {} for t in tools or [] if t.get("type", "function") == "function"
    ]
    if functions:
        content = content.with_function_tools(
            [
                ToolDescription.new(f["name"], f.get("description") or "", f.get("parameters"))
                for f in functions
            ]
        )
    return Message.from_role_and_content(Role.DEVELOPER, content)


def render(
    messages: list[dict],
    tools: list[dict] | None,
    effort: str = "",
    reasoning: bool | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The prompt's token ids: the conversation in harmony, then `<|start|>assistant`."""
    from openai_harmony import Author, Conversation, Message, Role, SystemContent, TextContent

    from engine.o200k import harmony_encoding

    kwargs = template_kwargs or {}
    system = SystemContent.new().with_reasoning_effort(
        _effort(effort or kwargs.get("reasoning_effort") or "", reasoning)
    )
    if isinstance(kwargs.get("model_identity"), str):
        system = system.with_model_identity(kwargs["model_identity"])
    normalized = normalize_messages(messages)
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    conversation = [Message.from_role_and_content(Role.SYSTEM, system)]
    if lead or tools:
        conversation.append(_developer([m["content"] for m in normalized[:lead]], tools))
    names = {
        call.get("id"): (call.get("function") or {}).get("name", "")
        for m in messages
        for call in m.get("tool_calls") or []
    }
    for i, (message, raw) in enumerate(zip(normalized[lead:], messages[lead:]), start=lead):
        role = message["role"]
        if role == "assistant":
            conversation += _assistant(message, raw)
        elif role == "tool":
            name = names.get(message.get("tool_call_id")) or message.get("name")
            if not name:
                raise invalid(f"messages[{i}]: its tool_call_id answers no earlier tool call")
            conversation.append(
                Message.from_author_and_content(
                    Author.new(Role.TOOL, f"functions.{name}"), message["content"]
                )
                .with_channel("commentary")
                .with_recipient("assistant")
            )
        elif role == "system":
            conversation.append(
                Message.from_role_and_contents(
                    Role.DEVELOPER, [TextContent(text=message["content"])]
                )
            )
        else:
            conversation.append(Message.from_role_and_content(Role.USER, message["content"]))
    return harmony_encoding().render_conversation_for_completion(
        Conversation.from_messages(conversation), Role.ASSISTANT
    )
