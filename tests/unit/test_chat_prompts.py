"""demo/chat_prompts.py: the SmolLM2 head's training prompts and the benchmark's held-out ones
never meet, tool-call prompts offer the tools and show one call, and prompts come out in the
model's own chat template (SmolLM2's, here over the demo tokenizer's vocabulary)."""

from __future__ import annotations

import json
import os
import shutil

from demo import chat_prompts
from engine.tokenizer import Tokenizer

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_no_benchmark_prompt_is_trained_on():
    trained = {json.dumps(m) for m in chat_prompts.training(600, seed=4321)}
    for kind in chat_prompts.KINDS:
        held = chat_prompts.held_out(kind, 16)
        assert len(held) == 16 and len({json.dumps(m) for m in held}) == 16
        assert all(chat_prompts.is_held_out(m) for m in held)
        assert not trained & {json.dumps(m) for m in held}
        trained_users = {json.loads(t)[-1]["content"] for t in trained}
        assert not trained_users & {m[-1]["content"] for m in held}


def test_training_mixes_the_three_kinds_evenly():
    drawn = chat_prompts.training(300, seed=1)
    tool_calls = [m for m in drawn if m[0]["role"] == "system"]
    assert len(drawn) == 300 and len(tool_calls) == 100


def test_a_tool_call_prompt_offers_the_tools_and_shows_one_call():
    for messages in chat_prompts.held_out("tool_call", 8):
        system, example, call, asked = messages
        offered = [json.loads(line) for line in system["content"].splitlines()[1:-1]]
        # an agent's prompt: every tool, the same system prompt and worked call each time
        assert [t["name"] for t in offered] == sorted(chat_prompts.TOOLS)
        assert json.loads(call["content"]) == {
            "name": "get_time",
            "arguments": {"timezone": "Asia/Tokyo"},
        }
        assert (example["role"], call["role"], asked["role"]) == ("user", "assistant", "user")


def test_prompts_render_in_the_models_own_template(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO, name), tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE)
    tokenizer = Tokenizer(str(tmp_path))
    messages = chat_prompts.held_out("chat", 1)[0]
    ids = chat_prompts.render(tokenizer, messages)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{messages[0]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
