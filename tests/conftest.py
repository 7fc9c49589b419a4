"""Shared fixtures: tiny random Hugging Face checkpoints built by transformers, saved once per session."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import ARCHITECTURES, build_hf_model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(arch) -> (transformers model in eval mode, folder with its checkpoint)."""
    cache: dict[str, tuple] = {}

    def make(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            model = build_hf_model(arch)
            model.save_pretrained(folder, **ARCHITECTURES[arch].get("save", {}))
            cache[arch] = (model, str(folder))
        return cache[arch]

    return make


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
