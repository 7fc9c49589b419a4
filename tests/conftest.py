"""Shared fixtures: tiny random Hugging Face checkpoints built by transformers, saved once per session."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import engine.triton  # noqa: F401  (without CUDA, Triton's interpreter: before anything imports triton)
from tests.tiny_models import ARCHITECTURES, build_hf_model

TIERS = ("unit", "golden", "integration", "e2e")


def pytest_collection_modifyitems(items):
    """Every test is marked with its folder's tier (pyproject.toml names them)."""
    for item in items:
        tier = next((t for t in TIERS if f"/tests/{t}/" in str(item.path)), None)
        if tier:
            item.add_marker(tier)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(arch) -> (transformers model in eval mode, folder with its checkpoint)."""
    cache: dict[str, tuple] = {}

    def make(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            model = build_hf_model(arch)
            model.save_pretrained(folder, **ARCHITECTURES[arch].get("save", {}))
            if "layout" in ARCHITECTURES[arch]:  # as a family publishes it (tests/tiny_models.py)
                model = ARCHITECTURES[arch]["layout"](str(folder), model) or model
            cache[arch] = (model, str(folder))
        return cache[arch]

    return make


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def chat_checkpoint(hf_checkpoint, tmp_path_factory):
    """The tiny Llama checkpoint plus a byte-level BPE tokenizer and a chat template."""
    folder = tmp_path_factory.mktemp("with-tokenizer")
    shutil.copytree(hf_checkpoint("llama")[1], folder, dirs_exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=380,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": TEMPLATE,
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
            }
        )
    )
    return folder


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
