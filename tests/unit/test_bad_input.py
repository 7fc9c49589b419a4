"""Bad requests and broken checkpoints get one clear error; the engine keeps serving."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.config import EngineConfig
from engine.errors import CheckpointError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    return LLMEngine(
        EngineConfig(model=hf_checkpoint("llama")[1], dtype="float32", kv_cache_bytes=8 << 20)
    )


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([1, 2, 384], GREEDY, "outside the vocabulary"),
        ([1, -1], GREEDY, "outside the vocabulary"),
        ([], GREEDY, "empty"),
        (list(range(300)) * 2, GREEDY, "the context is 512"),
        ([1, 2, 3], SamplingParams(max_tokens=600), "exceeds the context"),
    ],
)
def test_bad_request_is_refused_and_engine_keeps_serving(engine, prompt, params, message):
    expected = engine.generate([[9, 10, 11]], GREEDY)[0].token_ids
    engine.add_request("running", [5, 6, 7], GREEDY)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", prompt, params)
    assert engine.generate([[9, 10, 11]], GREEDY)[0].token_ids == expected
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
    ],
)
def test_bad_sampling_values_are_refused(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**fields)


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("to-abort", list(range(40)), SamplingParams(max_tokens=100))
    engine.step()
    assert engine.num_free_blocks < engine.num_blocks
    assert engine.abort("to-abort")
    assert engine.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.fixture
def broken_copy(hf_checkpoint, tmp_path):
    source = hf_checkpoint("llama")[1]
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    return folder


def test_missing_weights_file(broken_copy):
    os.remove(broken_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLMEngine(EngineConfig(model=str(broken_copy)))


def test_truncated_weights_file(broken_copy):
    path = broken_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        LLMEngine(EngineConfig(model=str(broken_copy)))


def test_garbage_weights_header(broken_copy):
    (broken_copy / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"
    )
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        LLMEngine(EngineConfig(model=str(broken_copy)))


def test_unsupported_architecture(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(broken_copy)))


def test_not_a_model_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
