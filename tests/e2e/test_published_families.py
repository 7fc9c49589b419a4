"""Qwen3, Llama 3.1 and Mistral Nemo as published, served through `make run MODEL=`: each tiny
checkpoint carries the family's real vocabulary (tests/published_tokenizers.py) and its
chat_template.jinja (tests/fixtures/templates), and is rigged to answer the weather question
in the family's own markup. Through the openai SDK: the prompt is transformers'
apply_chat_template token for token, the call comes back as tool_calls with no markup in
content, unary and streamed, Qwen3's <think> comes back as reasoning_content, and a tool round
trip renders as the template says."""

from __future__ import annotations

import json
import os

import openai
import transformers

from tests.e2e.test_published_checkpoints import TEMPLATES, WEATHER_QUESTION, WEATHER_TOOL, served
from tests.published_tokenizers import llama31_tokenizer, mistral_nemo_tokenizer, qwen3_tokenizer
from tests.tiny_models import build_hf_model, rig_reply

ARGUMENTS = {"city": "Paris"}
REASONING = "The user wants the weather."


def rigged(folder: str, arch: str, write_tokenizer, template: str, reply: str, **config) -> str:
    """A tiny `arch` checkpoint (64 wide: a reply under 64 tokens can be rigged; untied) with
    `config` over its tiny one, in `folder` with the family's tokenizer and published template,
    its lm_head solved so that greedy decoding answers WEATHER_QUESTION (with WEATHER_TOOL) with `reply`."""
    from services.gateway.prepare.requests import ServedModel, chat_prompt
    from services.gateway.protocol import ChatRequest, SamplingOptions

    model = build_hf_model(arch, **config, tie_word_embeddings=False)
    model.save_pretrained(folder)
    write_tokenizer(folder, open(os.path.join(TEMPLATES, template)).read())
    with open(os.path.join(folder, "generation_config.json")) as f:
        for key, ids in json.load(
            f
        ).items():  # the family's BOS and end-of-turn ids in config.json too, as published
            setattr(model.config, key, ids)
            setattr(model.generation_config, key, ids)
    served_model = ServedModel.from_folder(folder)
    prompt = chat_prompt(
        ChatRequest(messages=[WEATHER_QUESTION], options=SamplingOptions(), tools=[WEATHER_TOOL]),
        served_model,
    )
    rig_reply(model, prompt, served_model.tokenizer.encode(reply))
    model.save_pretrained(folder)
    return folder


def call_and_stream(client, name: str, hf, reasoning: str = "", content: str = ""):
    """The weather question, unary and streamed: one get_weather call, no markup in content
    (`content`: the text outside the markup), `reasoning` as reasoning_content, the prompt as
    transformers renders it. Returns the call."""
    ask = dict(
        model=name, messages=[WEATHER_QUESTION], tools=[WEATHER_TOOL], max_tokens=100, temperature=0
    )
    reply = client.chat.completions.create(**ask)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert (message.content or "") == content
    assert (message.model_extra.get("reasoning_content") or "") == reasoning
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGUMENTS)
    expected = hf.apply_chat_template(
        [WEATHER_QUESTION],
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert reply.usage.prompt_tokens == len(expected)

    deltas = [
        c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True) if c.choices
    ]
    assert "".join(d.content or "" for d in deltas) == content
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    streamed = [c for d in deltas for c in d.tool_calls or []]
    assert [c.function.name for c in streamed if c.function.name] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in streamed)) == ARGUMENTS
    return call


def round_trip(client, name: str, hf, call, markup: str, assistant: dict | None = None) -> None:
    """The call's result sent back (`role: tool`): the prompt is the template's rendering of the
    conversation (the call's arguments as an object, as transformers documents), which shows `markup`."""
    assistant = assistant or {}
    history = [
        WEATHER_QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()], **assistant},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    turn = client.chat.completions.create(
        model=name, messages=history, tools=[WEATHER_TOOL], max_tokens=1
    )
    as_object = [
        {
            **history[1],
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        }
    ]
    expected = hf.apply_chat_template(
        history[:1] + as_object + history[2:],
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert markup in expected, expected
    assert turn.usage.prompt_tokens == len(hf.encode(expected, add_special_tokens=False))


QWEN3_REPLY = (
    f"<think>\n{REASONING}\n</think>\n\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}\n</tool_call><|im_end|>'
)


def test_qwen3_thinks_and_calls_a_tool_through_make_run(tmp_path):
    """Qwen3's vocabulary is Qwen's byte-level BPE ranks as the dashscope package ships them
    (`qwen.tiktoken`, unchanged since Qwen1) with Qwen3's added tokens at their published ids
    (<|im_start|>, <tool_call>, <think>, ...): no pip package carries Qwen3's tokenizer.json
    itself. The hermes and qwen3 parsers, found without flags; enable_thinking false renders
    as the template says; the reasoning sent back renders inside <think>."""
    folder = rigged(
        str(tmp_path / "Qwen3-8B"),
        "qwen3",
        qwen3_tokenizer,
        "Qwen-Qwen3-0.6B.jinja",
        QWEN3_REPLY,
        vocab_size=151936,
    )
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        name = os.path.basename(folder)
        # As vLLM splits it: the newlines the template writes around the reasoning and after
        # </think> stay in reasoning_content and content (tests/unit/gateway/test_reasoning.py).
        call = call_and_stream(client, name, hf, reasoning=f"\n{REASONING}\n", content="\n\n")
        round_trip(
            client,
            name,
            hf,
            call,
            "<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>",
            assistant={"reasoning_content": REASONING},
        )

        off = client.chat.completions.create(
            model=name,
            messages=[WEATHER_QUESTION],
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        expected = hf.apply_chat_template(
            [WEATHER_QUESTION],
            add_generation_prompt=True,
            enable_thinking=False,
            tokenize=True,
            return_dict=False,
        )
        assert hf.decode(expected).endswith(
            "<think>\n\n</think>\n\n"
        ) and off.usage.prompt_tokens == len(expected)


LLAMA_REPLY = f'{{"name": "get_weather", "parameters": {json.dumps(ARGUMENTS)}}}<|eot_id|>'


def test_llama31_calls_a_tool_in_json_through_make_run(tmp_path):
    """Llama 3.1's tiktoken vocabulary from the llama-models package, as tokenizer.json (the
    published checkpoint's, converted by transformers' TikTokenConverter), and its template
    (tools in the first user message): the llama3_json parser, found without flags; the result
    goes back as the ipython turn."""
    folder = rigged(
        str(tmp_path / "Llama-3.1-8B-Instruct"),
        "llama",
        llama31_tokenizer,
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        LLAMA_REPLY,
        vocab_size=128256,
    )
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        name = os.path.basename(folder)
        call = call_and_stream(client, name, hf)
        round_trip(
            client,
            name,
            hf,
            call,
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
            '{"city": "Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 C"<|eot_id|>',
        )


NEMO_REPLY = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}]</s>'


def test_mistral_nemo_calls_a_tool_through_make_run(tmp_path):
    """Mistral Nemo's tekken vocabulary from mistral-common, as tokenizer.json (transformers'
    MistralConverter), and its template: the mistral parser, found without flags, reads
    [TOOL_CALLS] though it is a special token; the call's id is the 9 alphanumerics that the
    template demands of the round trip, as vLLM writes them."""
    # Nemo's head_dim is not hidden_size / heads (128, not 5120 / 32), and its rope is plain.
    folder = rigged(
        str(tmp_path / "Mistral-Nemo-Instruct-2407"),
        "mistral",
        mistral_nemo_tokenizer,
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        NEMO_REPLY,
        vocab_size=131072,
        head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    )
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        name = os.path.basename(folder)
        call = call_and_stream(client, name, hf)
        assert len(call.id) == 9 and call.id.isalnum()
        round_trip(
            client,
            name,
            hf,
            call,
            f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{call.id}"}}]</s>'
            f'[TOOL_RESULTS]{{"content": sunny, 21 C, "call_id": "{call.id}"}}[/TOOL_RESULTS]',
        )
