"""Llama 4 served through `make run MODEL=`: the Scout-like (nested, vision tensors, 16 experts,
NoPE every fourth layer, chunks of 12) and Maverick-like (dense layers between MoE ones, FBGEMM
FP8, chunks of 20) checkpoints of tests/llama4_models.py answer a completion of token ids
longer than a chunk with transformers' greedy tokens and per-step logprobs on the same weights.

A Llama 4 rigged to answer the weather question with a JSON tool call in its markup (Llama 4's
real vocabulary from llama-models, Meta's published template) gives the call back through the
openai SDK (chat, Responses) and the anthropic SDK (Messages), unary and streamed; its prompts
count the tokens transformers renders from the template; a plain conversation's equal
llama-models' ChatFormat. Without a template of its own (tandem's, which writes tool turns as
llama-models does) a tool round trip counts llama-models' ChatFormat tokens."""

from __future__ import annotations

import json
import os

import anthropic
import openai
import pytest
import torch

from engine.tokenizer import Tokenizer
from tests.e2e.test_gpt_oss_run import assert_serves_transformers_greedy
from tests.e2e.test_published_checkpoints import (
    WEATHER_QUESTION,
    WEATHER_TOOL,
    served,
    streamed_calls,
)
from tests.llama4_models import SCOUT, maverick, scout
from tests.unit.test_llama4_vocab import CONVERSATION, llama4_folder, published_template, reference

PROMPT = list(range(40, 77))  # 37 tokens: past Scout's chunks (12, 24, 36) and Maverick's (20)
# As llama-models writes and reads a custom call: JSON in the python markup, ended by <|eom|>
REPLY = (
    '<|python_start|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|python_end|><|eom|>'
)
CALL = ("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (transformers' reference, the folder)."""
    made = {}

    def make(name: str):
        if name not in made:
            folder = str(tmp_path_factory.mktemp(name))
            made[name] = ({"scout": scout, "maverick": maverick}[name](folder), folder)
        return made[name]

    return make


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_make_run_serves_transformers_tokens_and_logprobs(name, checkpoint):
    reference_model, folder = checkpoint(name)
    assert_serves_transformers_greedy(reference_model, folder, PROMPT)


@pytest.fixture(scope="module")
def rigged(tmp_path_factory) -> dict[str, str]:
    """A text-layout Llama 4 (Scout's layers, 128 wide to be rigged, the real vocabulary's
    202,048 rows) rigged to answer the weather question, offered the weather tool, with REPLY;
    saved twice: with Meta's published template ("published") and with none ("tandem")."""
    import transformers
    from safetensors.torch import load_file, save_file

    from services.gateway.prepare.requests import ServedModel, chat_prompt
    from services.gateway.protocol import ChatRequest, SamplingOptions
    from tests.tiny_models import rig_reply

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        **dict(SCOUT, vocab_size=202048, hidden_size=128),
        bos_token_id=200000,
        eos_token_id=[200001, 200007, 200008],  # the published generation_config's
        pad_token_id=200018,
        tie_word_embeddings=False,
    )
    config.architectures = ["Llama4ForCausalLM"]
    model = transformers.Llama4ForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("llama4-rigged")
    folders = {
        "published": llama4_folder(
            root / "Llama-4-published", config.to_dict(), published_template()
        ),
        "tandem": llama4_folder(root / "Llama-4-tandem", config.to_dict()),
    }
    model.save_pretrained(folders["published"])
    served_model = ServedModel.from_folder(folders["published"])
    question = ChatRequest(
        messages=[WEATHER_QUESTION], options=SamplingOptions(), tools=[WEATHER_TOOL]
    )
    prompt = chat_prompt(question, served_model)
    # tandem's template offers tools as Meta's does: one rig answers both
    assert prompt == chat_prompt(question, ServedModel.from_folder(folders["tandem"]))
    rig_reply(model, prompt, served_model.tokenizer.encode(REPLY))
    weights = load_file(os.path.join(folders["published"], "model.safetensors"))
    weights["lm_head.weight"] = model.lm_head.weight.detach().contiguous()
    save_file(weights, os.path.join(folders["published"], "model.safetensors"))
    os.remove(os.path.join(folders["tandem"], "config.json"))  # llama4_folder's placeholder
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        os.link(os.path.join(folders["published"], name), os.path.join(folders["tandem"], name))
    return folders


def test_llama_models_reads_the_rigged_reply_as_the_call():
    """REPLY is Llama 4's own markup: llama-models' decoder finds the same call in it."""
    reference([WEATHER_QUESTION])  # first: it stands in for the image transforms imported below
    from llama_models.datatypes import StopReason
    from llama_models.llama4.chat_format import ChatFormat
    from llama_models.llama4.tokenizer import Tokenizer as MetaTokenizer

    message = ChatFormat(MetaTokenizer.get_instance()).decode_assistant_message_from_content(
        REPLY, StopReason.end_of_message
    )
    assert [(c.tool_name, c.arguments) for c in message.tool_calls] == [CALL]


def _rendered(tokenizer, messages: list[dict], tools) -> list[int]:
    """transformers' rendering of the folder's template, encoded."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from services.gateway.prepare.chat import normalize_messages

    [text], _ = render_jinja_template(
        conversations=[normalize_messages(messages)],
        tools=tools,
        chat_template=tokenizer.chat_template,
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot|>",
    )
    return tokenizer.encode(text)


def test_published_llama4_calls_the_tool_in_each_api_through_make_run(rigged):
    """Meta's template and the real vocabulary, the llama4_json parser found without flags: the
    call with no markup in content, unary and streamed, in chat, Responses and Messages; the
    prompt is transformers' rendering of the template, a round trip's too; a plain
    conversation's is llama-models' ChatFormat's."""
    folder = rigged["published"]
    tokenizer = Tokenizer(folder)
    name = os.path.basename(folder)
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model=name, messages=[WEATHER_QUESTION], tools=[WEATHER_TOOL], max_tokens=60)
        reply = client.chat.completions.create(**ask, temperature=0)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content in ("", None)
        [call] = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == CALL
        assert reply.usage.prompt_tokens == len(
            _rendered(tokenizer, [WEATHER_QUESTION], [WEATHER_TOOL])
        )

        deltas = [
            c.choices[0].delta
            for c in client.chat.completions.create(**ask, temperature=0, stream=True)
            if c.choices
        ]
        assert "".join(d.content or "" for d in deltas) == ""
        assert [c[1:] for c in streamed_calls(deltas)] == [
            (call.function.name, call.function.arguments)
        ]

        history = [
            WEATHER_QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ]
        turn = client.chat.completions.create(
            model=name, messages=history, tools=[WEATHER_TOOL], max_tokens=1
        )
        expected = _rendered(tokenizer, history, [WEATHER_TOOL])
        # Meta's markup for a past call and its result (llama-models writes both otherwise)
        assert (
            '<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": '
            '"Paris"}}<|eot|><|header_start|>ipython<|header_end|>\n\n"sunny, 21 C"<|eot|>'
        ) in tokenizer.decode(expected, skip_special_tokens=False)
        assert turn.usage.prompt_tokens == len(expected)
        plain = [CONVERSATION[0], CONVERSATION[1], CONVERSATION[4], CONVERSATION[5]]
        turn = client.chat.completions.create(model=name, messages=plain, max_tokens=1)
        assert turn.usage.prompt_tokens == len(reference(plain))

        tool = {"type": "function", **WEATHER_TOOL["function"]}
        response = client.responses.create(
            model=name, input=[WEATHER_QUESTION], tools=[tool], temperature=0, max_output_tokens=60
        )
        assert [(i.type, i.name, json.loads(i.arguments)) for i in response.output] == [
            ("function_call", *CALL)
        ]
        events = list(
            client.responses.create(
                model=name,
                input=[WEATHER_QUESTION],
                tools=[tool],
                temperature=0,
                max_output_tokens=60,
                stream=True,
            )
        )
        assert [(i.type, i.name) for i in events[-1].response.output] == [
            ("function_call", CALL[0])
        ]

        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
        anthropic_ask = dict(
            model=name,
            max_tokens=60,
            messages=[WEATHER_QUESTION],
            tools=[
                {
                    "name": "get_weather",
                    "description": "Current weather",
                    "input_schema": WEATHER_TOOL["function"]["parameters"],
                }
            ],
        )
        message = claude.messages.create(**anthropic_ask)
        assert message.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", *CALL)]
        with claude.messages.stream(**anthropic_ask) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", *CALL)]


def test_llama4_without_a_template_renders_llama_models_round_trip_through_make_run(rigged):
    """tandem's template (llama-models' ChatFormat): the call comes back, and a tool round trip
    through chat and through Messages counts llama-models' prompt tokens."""
    folder = rigged["tandem"]
    name = os.path.basename(folder)
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=name,
            messages=[WEATHER_QUESTION],
            tools=[WEATHER_TOOL],
            max_tokens=60,
            temperature=0,
        )
        [call] = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == CALL
        history = [
            WEATHER_QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ]
        expected = len(reference(history))
        turn = client.chat.completions.create(model=name, messages=history, max_tokens=1)
        assert turn.usage.prompt_tokens == expected

        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
        turn = claude.messages.create(
            model=name,
            max_tokens=1,
            messages=[
                WEATHER_QUESTION,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": call.id, "name": CALL[0], "input": CALL[1]}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}
                    ],
                },
            ],
        )
        usage = turn.usage  # Anthropic's input_tokens leave out what was read from the cache
        assert usage.input_tokens + usage.cache_read_input_tokens == expected
