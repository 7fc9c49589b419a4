"""Each family's tool-call markup (tool_calls.py reads it as it streams), under vLLM's parser
names, and which one a checkpoint speaks: `--tool-call-parser NAME`, else detected from its
chat template's markup and its model_type, else `hermes` (the demo model's). Every format but
qwen3_coder streams its calls' arguments as they are written (tool_streams.py); qwen3_coder's
are XML parameters, turned into JSON, so its calls come whole when their span closes.

- hermes (Qwen2.5, Qwen3, the demo): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- qwen3_coder: `<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`
- llama3_json (Llama 3.1+): `{"name": ..., "parameters": {...}}` as the whole output, optionally
  after `<|python_tag|>`, several separated by `;`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v1-v3 tokenizers) or
  `[TOOL_CALLS]NAME[ARGS]{...}` (v11+), to the end of the output; call ids are 9 alphanumerics,
  which Mistral's templates demand of a round trip (vLLM's too), and longer ids sent back are
  cut to their last 9, as vLLM cuts them
- deepseek_v3 (V3, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
- deepseek_v31 (V3.1+): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...`
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>`; the call keeps Kimi's id `functions.NAME:IDX`, and the
  conversation reaches Kimi's template as Moonshot's code prepares it (call ids, key-sorted tools)
- llama4_json, llama4_pythonic (Llama 4): `{"name": ..., "parameters": {...}}` or
  `[NAME(KEY=VALUE, ...)]` as the whole output, optionally inside `<|python_start|>`
  ... `<|python_end|>` (output/llama4_tools.py); pythonic when the template asks for that form
- openai (gpt-oss, harmony): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
  one call a message; read token by token with openai-harmony (output/harmony.py), not as text,
  and the prompt rendered by openai-harmony too (prepare/harmony.py)
"""

from __future__ import annotations

import json
import random
import re
import string

from services.gateway.output import llama4_tools
from services.gateway.output.harmony import CALL_FORMAT as HARMONY_FORMAT
from services.gateway.output.tool_calls import END_TAG, START_TAG, CallFormat, ToolCall, call_from
from services.gateway.output.tool_streams import CallShape, CallStream


def _all_or_none(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    return calls if calls and all(c is not None for c in calls) else None


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes(body: str):
    call = _json(body)
    if not isinstance(call, dict):
        return None
    return _all_or_none(
        [call_from(call.get("name"), call.get("arguments", call.get("parameters", {})))]
    )


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _qwen3_coder(body: str):
    def value(text: str):
        parsed = _json(text)
        return text if parsed is None else parsed

    functions = _FUNCTION.findall(body)
    return _all_or_none(
        [
            call_from(name.strip(), {p.strip(): value(v) for p, v in _PARAMETER.findall(params)})
            for name, params in functions
        ]
    )


def _json_calls(text: str) -> list[ToolCall | None]:
    calls = _json(text)
    calls = calls if isinstance(calls, list) else [calls]
    return [
        call_from(c.get("name"), c.get("arguments", c.get("parameters", {})))
        if isinstance(c, dict)
        else None
        for c in calls
    ]


def _llama3_json(body: str):
    body = body.removeprefix("<|python_tag|>").strip()
    parts, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):  # objects separated by ';'
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        parts.append(obj)
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return _all_or_none(
        [
            call_from(o.get("name"), o.get("parameters", o.get("arguments", {})))
            if isinstance(o, dict)
            else None
            for o in parts
        ]
    )


def mistral_call_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _mistral(body: str):
    if body.startswith(("[", "{")):
        calls = _json_calls(body)
    else:
        calls = []
        for part in filter(None, (p.strip() for p in body.split("[TOOL_CALLS]"))):
            name, sep, arguments = part.partition("[ARGS]")
            calls.append(call_from(name.strip(), arguments) if sep else None)
    return _all_or_none([c and ToolCall(c.name, c.arguments, mistral_call_id()) for c in calls])


def mistral_conversation(
    messages: list[dict], tools: list | None
) -> tuple[list[dict], list | None]:
    """Call ids as Mistral's templates take them: longer ones cut to their last 9 characters."""

    def cut(call_id):
        return call_id[-9:] if isinstance(call_id, str) and len(call_id) > 9 else call_id

    out = []
    for message in messages:
        if message.get("tool_calls"):
            message = {
                **message,
                "tool_calls": [{**c, "id": cut(c.get("id"))} for c in message["tool_calls"]],
            }
        if message.get("tool_call_id"):
            message = {**message, "tool_call_id": cut(message["tool_call_id"])}
        out.append(message)
    return out, tools


_DEEPSEEK_V3_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```\s*<｜tool▁call▁end｜>",
    re.S,
)
_DEEPSEEK_V31_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S
)


def _deepseek_v3(body: str):
    return _all_or_none(
        [call_from(name.strip(), args) for _, name, args in _DEEPSEEK_V3_CALL.findall(body)]
    )


def _deepseek_v31(body: str):
    return _all_or_none(
        [call_from(name.strip(), args) for name, args in _DEEPSEEK_V31_CALL.findall(body)]
    )


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.S,
)


def _kimi_k2(body: str):
    calls = []
    for call_id, arguments in _KIMI_CALL.findall(body):
        name = call_id.removeprefix("functions.").rsplit(":", 1)[0]  # functions.NAME:IDX
        calls.append(call_from(name, arguments, call_id))
    return _all_or_none(calls)


_HARMONY_CALL = re.compile(r"^\s*([^\s<]+)\s*(?:<\|constrain\|>\s*\w+\s*)?<\|message\|>(.*)$", re.S)


def _harmony(body: str):
    """One call's message after `to=functions.`: NAME [<|constrain|>json]<|message|>{...}."""
    match = _HARMONY_CALL.match(body)
    return _all_or_none([call_from(match[1], match[2]) if match else None])


# Forced calls (prepare/structured.py): one call of one of `names`, its arguments following
# their schema, in the format's own markup. `tag(text)`: a marker as lark matches it (its token where it is one).


def _rules(alternatives: list[str], schemas: list[dict]) -> str:
    """`call: alt0 | alt1 ...`, each alternative ending in its arguments' JSON rule."""
    calls = " | ".join(f"{alt} args{i}" for i, alt in enumerate(alternatives))
    return f"call: {calls}\n" + "".join(
        f"args{i}: %json {json.dumps(s)}\n" for i, s in enumerate(schemas)
    )


def _call_object(names, schemas, arguments_key: str) -> dict:
    """The schema of a call as one JSON object, {"name": ..., arguments_key: {...}}."""
    options = schemas[0]["x-guidance"]  # the JSON options, at the top of the object only
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": n},
                arguments_key: {k: v for k, v in s.items() if k != "x-guidance"},
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for n, s in zip(names, schemas)
    ]
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": options}


def _hermes_forced(names, schemas, tag, index):
    call = json.dumps(_call_object(names, schemas, "arguments"))
    return f"start: {tag(START_TAG)} call {tag(END_TAG)}\ncall: %json {call}\n"


def _llama3_forced(names, schemas, tag, index):
    return f"start: call\ncall: %json {json.dumps(_call_object(names, schemas, 'parameters'))}\n"


def _kimi_forced(names, schemas, tag, index):
    alternatives = [
        f"{json.dumps(f'functions.{n}:{index}')} {tag('<|tool_call_argument_begin|>')}"
        for n in names
    ]
    return (
        f"start: {tag('<|tool_calls_section_begin|>')} {tag('<|tool_call_begin|>')} call "
        f"{tag('<|tool_call_end|>')} {tag('<|tool_calls_section_end|>')}\n"
        + _rules(alternatives, schemas)
    )


def _harmony_forced(names, schemas, tag, index):
    alternatives = [
        f"{json.dumps(f'commentary to=functions.{n} ')} {tag('<|constrain|>')} "
        f'"json" {tag("<|message|>")}'
        for n in names
    ]
    return f"start: {tag('<|channel|>')} call\n" + _rules(alternatives, schemas)


def _deepseek_v31_forced(names, schemas, tag, index):
    alternatives = [f"{json.dumps(n)} {tag('<｜tool▁sep｜>')}" for n in names]
    return (
        f"start: {tag('<｜tool▁calls▁begin｜>')} {tag('<｜tool▁call▁begin｜>')} call {tag('<｜tool▁call▁end｜>')} "
        f"{tag('<｜tool▁calls▁end｜>')}\n" + _rules(alternatives, schemas)
    )


def _deepseek_v3_forced(names, schemas, tag, index):
    alternatives = [
        f'"function" {tag("<｜tool▁sep｜>")} {json.dumps(n + chr(10) + "```json" + chr(10))}'
        for n in names
    ]
    return (
        f'start: {tag("<｜tool▁calls▁begin｜>")} {tag("<｜tool▁call▁begin｜>")} call "\\n```" '
        f"{tag('<｜tool▁call▁end｜>')} {tag('<｜tool▁calls▁end｜>')}\n"
        + _rules(alternatives, schemas)
    )


DEEPSEEK = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)
HARMONY = ("<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>")
KIMI = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


def kimi_call_ids(messages: list[dict]) -> list[dict]:
    """Tool-call ids as Kimi's template shows them and Moonshot's API writes them,
    `functions.NAME:IDX` (IDX counting the conversation's calls), each tool result's id mapped alike."""
    renamed, count, out = {}, 0, []
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                new = call["id"]
                if not new.startswith("functions."):
                    new = renamed[call["id"]] = f"functions.{call['function']['name']}:{count}"
                count += 1
                calls.append({**call, "id": new})
            message = {**message, "tool_calls": calls}
        if message.get("tool_call_id") in renamed:
            message = {**message, "tool_call_id": renamed[message["tool_call_id"]]}
        out.append(message)
    return out


def sorted_keys(value):
    """Every dict's keys in order, all the way down: how Kimi's tokenizer hands tools to its template."""
    if isinstance(value, dict):
        return {k: sorted_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [sorted_keys(v) for v in value]
    return value


def kimi_conversation(messages: list[dict], tools: list | None) -> tuple[list[dict], list | None]:
    """As Moonshot's tokenizer code and API prepare a conversation for Kimi's template."""
    return kimi_call_ids(messages), sorted_keys(tools)


# How each format's calls stream (tool_streams.py): the pattern to the end of the first call's
# name, from one call's arguments to the end of the next one's name, and from a name to its
# arguments' `{`. A JSON object's call: {"name": "NAME", "arguments": {...}}.
_NAME = r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\\x00-\x1f]|\\.)*)"'
_OBJECT_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_BRACE = re.compile(r"\s*(?=\{)")


def _shape(first: str, next_: str | None, arguments: re.Pattern = _BRACE) -> CallShape:
    return CallShape(re.compile(first), re.compile(next_) if next_ else None, arguments)


HERMES_STREAM = CallStream((_shape(r"\s*" + _NAME, None, _OBJECT_ARGUMENTS),))
LLAMA3_STREAM = CallStream(
    (_shape(r"\s*(?:<\|python_tag\|>)?\s*" + _NAME, r"\s*\}\s*;\s*" + _NAME, _OBJECT_ARGUMENTS),)
)
MISTRAL_STREAM = CallStream(
    (  # v1-v3: a JSON list of calls (or one); v11+: NAME[ARGS]{...}, each after [TOOL_CALLS]
        _shape(r"\s*\[?\s*" + _NAME, r"\s*\}\s*,\s*" + _NAME, _OBJECT_ARGUMENTS),
        _shape(
            r"\s*(?P<bare>[^\[{\s\"][^\[]*?)\[ARGS\]",
            r"\s*\[TOOL_CALLS\]\s*(?P<bare>[^\[{\s\"][^\[]*?)\[ARGS\]",
        ),
    ),
    new_id=mistral_call_id,
)
_V31_CALL = r"<｜tool▁call▁begin｜>(?P<bare>[^｜]+?)<｜tool▁sep｜>"
DEEPSEEK_V31_STREAM = CallStream(
    (_shape(r"\s*" + _V31_CALL, r"\s*<｜tool▁call▁end｜>\s*" + _V31_CALL),)
)
_V3_CALL = r"<｜tool▁call▁begin｜>\w+<｜tool▁sep｜>(?P<bare>[^\n｜]*?)\n```json\n"
DEEPSEEK_V3_STREAM = CallStream(
    (_shape(r"\s*" + _V3_CALL, r"\s*```\s*<｜tool▁call▁end｜>\s*" + _V3_CALL),)
)
_KIMI_HEAD = r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>"
KIMI_STREAM = CallStream((_shape(r"\s*" + _KIMI_HEAD, r"\s*<\|tool_call_end\|>\s*" + _KIMI_HEAD),))

HERMES = CallFormat(
    "hermes",
    START_TAG,
    END_TAG,
    _hermes,
    forced=_hermes_forced,
    markers=(START_TAG, END_TAG),
    stream=HERMES_STREAM,
)
FORMATS = {
    f.name: f
    for f in (
        HERMES,
        CallFormat("qwen3_coder", START_TAG, END_TAG, _qwen3_coder, markers=(START_TAG, END_TAG)),
        CallFormat(
            "llama3_json",
            "<|python_tag|>",
            None,
            _llama3_json,
            opens_output=("{",),
            forced=_llama3_forced,
            markers=("<|python_tag|>",),
            stream=LLAMA3_STREAM,
        ),
        CallFormat(
            "llama4_json",
            llama4_tools.PYTHON_START,
            None,
            llama4_tools.llama4_json,
            opens_output=("{",),
            forced=_llama3_forced,
            markers=llama4_tools.MARKERS,
            stream=llama4_tools.JSON_STREAM,
        ),
        CallFormat(
            "llama4_pythonic",
            llama4_tools.PYTHON_START,
            None,
            llama4_tools.llama4_pythonic,
            opens_output=("[",),
            markers=llama4_tools.MARKERS,
            reader=llama4_tools.PythonicReader,
        ),
        CallFormat(
            "mistral",
            "[TOOL_CALLS]",
            None,
            _mistral,
            markers=("[TOOL_CALLS]", "[ARGS]"),
            conversation=mistral_conversation,
            stream=MISTRAL_STREAM,
        ),
        CallFormat(
            "deepseek_v3",
            *DEEPSEEK[:2],
            _deepseek_v3,
            forced=_deepseek_v3_forced,
            markers=DEEPSEEK,
            stream=DEEPSEEK_V3_STREAM,
        ),
        CallFormat(
            "deepseek_v31",
            *DEEPSEEK[:2],
            _deepseek_v31,
            forced=_deepseek_v31_forced,
            markers=DEEPSEEK,
            stream=DEEPSEEK_V31_STREAM,
        ),
        CallFormat(
            HARMONY_FORMAT,
            "<|channel|>commentary to=functions.",
            "<|call|>",
            _harmony,
            forced=_harmony_forced,
            markers=HARMONY,
            reply_head=("<|channel|>", "final", "<|message|>"),
        ),
        CallFormat(
            "kimi_k2",
            *KIMI[:2],
            _kimi_k2,
            forced=_kimi_forced,
            markers=KIMI,
            conversation=kimi_conversation,
            stream=KIMI_STREAM,
        ),
    )
}


def detect(template: str | None, model_type: str = "", name: str = "") -> CallFormat:
    """`name` (--tool-call-parser) if given; else the format the chat template writes."""
    if name:
        if name not in FORMATS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(FORMATS)}")
        return FORMATS[name]
    template = template or ""
    if model_type == "gpt_oss" or "<|channel|>" in template:
        return FORMATS[HARMONY_FORMAT]
    if "<|tool_calls_section_begin|>" in template or model_type in ("kimi_k2", "kimi_k25"):
        return FORMATS["kimi_k2"]
    if "<｜tool▁calls▁begin｜>" in template:
        return FORMATS["deepseek_v3" if "```json" in template else "deepseek_v31"]
    if "<function=" in template and "<parameter=" in template:
        return FORMATS["qwen3_coder"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|header_start|>" in template or model_type in ("llama4", "llama4_text"):
        return FORMATS["llama4_pythonic" if "[func_name1(" in template else "llama4_json"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FORMATS["llama3_json"]
    return HERMES
