"""The real default model through plain `make run`: SmolLM2-135M-Instruct from its published GGUF
file, driven by the openai SDK, against transformers' GGUF loader on the same file. Colocated
and disaggregated."""

from __future__ import annotations

import json
import os

import openai
import pytest
import torch

from deploy.processes import free_port
from engine.gguf.folder import embedded_path
from tests.e2e.make_run import start_make_run, stop

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a Python function that adds two numbers.",
]
# A request the model answers by copying, so prompt lookup has drafts to verify
COPY = (
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank."
)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference():
    """transformers on the same file, as it loads GGUF: dequantized to fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(embedded_path("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


def greedy(reference, messages) -> tuple[list[int], str, list[float], int]:
    """transformers' greedy reply: its tokens, text, per-token logprobs and the prompt's length."""
    tokenizer, model = reference
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(
        prompt,
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id,
    )
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    if tokens and tokens[-1] == tokenizer.eos_token_id:  # the stop token is not in the reply
        tokens, logprobs = tokens[:-1], logprobs[:-1]
    return tokens, tokenizer.decode(tokens), logprobs, prompt.shape[1]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def stack(request):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "SPECULATIVE")}
    run = start_make_run({**env, "PORT": str(port), "TOPOLOGY": request.param})
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
    )
    yield client
    stop(run)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_replies_and_logprobs_equal_transformers(stack, reference, prompt):
    client = stack
    messages = [{"role": "user", "content": prompt}]
    tokens, text, logprobs, prompt_len = greedy(reference, messages)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.usage.completion_tokens == len(tokens) + (reply.choices[0].finish_reason == "stop")
    served = reply.choices[0].logprobs.content[: len(logprobs)]
    torch.testing.assert_close(
        torch.tensor([t.logprob for t in served]), torch.tensor(logprobs), rtol=0, atol=1e-3
    )
    for item in served:  # greedy: the chosen token leads its top 3
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))


def test_the_capital_of_france_is_paris(stack):
    client = stack
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_reply_equals_the_whole_one_with_usage_and_cached_tokens(stack):
    client = stack
    messages = [
        {"role": "user", "content": "Tell me a short story about a robot who learns to paint."}
    ]
    args = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    # the same prompt again: its whole blocks come from the prefix cache
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= usage.prompt_tokens // 16 * 16 - 16 and cached > 0


def test_ngram_speculation_is_lossless_and_accepts_drafts(stack, reference):
    client = stack
    messages = [{"role": "user", "content": COPY}]
    _, text, _, _ = greedy(reference, messages)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_structured_output_follows_the_schema(stack):
    client = stack
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Which city is the capital of France? Answer in JSON."}
        ],
        temperature=0,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    assert reply.choices[0].finish_reason == "stop"
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"city", "is_capital"}
    assert isinstance(value["city"], str) and isinstance(value["is_capital"], bool)
