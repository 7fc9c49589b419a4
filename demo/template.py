"""The demo model's special tokens and chat template, and a renderer matching engine/tokenizer.py.

Rendered conversation (the newline after each role token and after <|end|> is literal):

    <|begin|><|system|>
    You are a helpful assistant.
    You can call these tools:
    {"type": "function", "function": {"name": "get_weather", ...}}
    To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|end|>
    <|user|>
    What's the weather in Paris?<|end|>
    <|assistant|>
    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call><|end|>
    <|tool|>
    {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"}<|end|>
    <|assistant|>
    It is 18 degrees celsius and sunny in Paris.<|end|>

<|end|> is the eos token. An assistant message's `tool_calls` (OpenAI shape, `arguments` a JSON
string or an object) render as `<tool_call>{"name": N, "arguments": A}</tool_call>` after its
content, so a conversation that carries an earlier tool call renders as the model wrote it.
"""

from __future__ import annotations

import json

BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS] + ROLE_TOKENS
# Added as whole tokens but not special: decode(skip_special_tokens=True) keeps them for the parser.
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
DEFAULT_SYSTEM = "You are a helpful assistant."

# Whitespace is controlled with `-` everywhere so the output is the same with or without
# trim_blocks/lstrip_blocks; '\n' inside Jinja string literals is a newline.
CHAT_TEMPLATE = (
    r"""
{%- macro text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content -%}{%- for part in content -%}{{- part['text'] if part['text'] is defined else '' -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = text(messages[0]['content']) -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set system = '"""
    + DEFAULT_SYSTEM
    + r"""' if tools else '' -%}
  {%- set rest = messages -%}
{%- endif -%}
{%- if system or tools -%}
  {{- '<|system|>\n' + system -}}
  {%- if tools -%}
    {{- '\nYou can call these tools:\n' -}}
    {%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
    {{- 'To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>' -}}
  {%- endif -%}
  {{- '<|end|>\n' -}}
{%- endif -%}
{%- for message in rest -%}
  {%- if message['role'] == 'assistant' -%}
    {{- '<|assistant|>\n' + text(message['content']) -}}
    {%- for call in message['tool_calls'] or [] -%}
      {%- set fn = call['function'] if call['function'] is defined else call -%}
      {{- '<tool_call>{"name": ' + (fn['name'] | tojson) + ', "arguments": ' -}}
      {%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}
      {{- '}</tool_call>' -}}
    {%- endfor -%}
    {{- '<|end|>\n' -}}
  {%- else -%}
    {{- '<|' + message['role'] + '|>\n' + text(message['content']) + '<|end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}
""".strip()  # noqa: E501 (byte for byte the template demo/tandem-demo ships)
)


def make_renderer():
    """render(messages, tools=None, add_generation_prompt=False) -> str, as engine/tokenizer.py renders."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    template = env.from_string(CHAT_TEMPLATE)

    def render(messages, tools=None, add_generation_prompt=False) -> str:
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=BOS,
            eos_token=EOS,
        )

    return render


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
