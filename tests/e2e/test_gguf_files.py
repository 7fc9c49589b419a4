"""GGUF files through `make run MODEL=<file>`: tiny models of each architecture answer as
transformers does on the same file, and a bad file is refused with one line naming it."""

from __future__ import annotations

import os

import gguf
import openai
import pytest
import torch

from deploy.processes import free_port
from tests.e2e.make_run import make_run, start_make_run, stop
from tests.gguf_deepseek2 import tiny_deepseek_v3, write_deepseek2_gguf
from tests.gguf_files import T, write_tiny_gguf
from tests.golden.test_gguf_deepseek2 import KINDS as DEEPSEEK2_KINDS
from tests.golden.test_gguf_deepseek2 import transformers_greedy as deepseek2_greedy
from tests.golden.test_gguf_parity import CASES, PROMPTS, STEPS, transformers_greedy


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache"), "PORT": str(free_port())}


def served_logprobs(env: dict[str, str], path: str) -> list[list[float]]:
    """`make run MODEL=path`'s greedy logprobs for each of PROMPTS."""
    run = start_make_run({**env, "MODEL": path, "SPECULATIVE": "off"})
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{env['PORT']}/v1", api_key="none", max_retries=0
        )
        model = os.path.basename(path).removesuffix(".gguf")
        return [
            client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=STEPS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .logprobs.token_logprobs
            for prompt in PROMPTS
        ]
    finally:
        stop(run)


def assert_close(served: list[list[float]], expected: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(served), torch.tensor(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_make_run_serves_a_gguf_file_as_transformers_reads_it(case, env, tmp_path):
    arch, kinds, tied = CASES[case]
    path = write_tiny_gguf(str(tmp_path / f"tiny-{case}.gguf"), arch, kinds, tied=tied)
    expected = [transformers_greedy(path, prompt)[1] for prompt in PROMPTS]
    assert_close(served_logprobs(env, path), expected)


def test_make_run_serves_a_deepseek2_file_as_transformers_serves_its_weights(env, tmp_path):
    """transformers cannot read deepseek2 files: its reference holds the file's own weights."""
    model = tiny_deepseek_v3("split")
    path = write_deepseek2_gguf(model, str(tmp_path / "tiny-deepseek2.gguf"), DEEPSEEK2_KINDS)
    expected = [deepseek2_greedy(model, prompt)[1] for prompt in PROMPTS]
    assert_close(served_logprobs(env, path), expected)


def refusal(env: dict[str, str], path: str) -> list[str]:
    """The lines saying why `make run MODEL=path` stopped: it exits non-zero, and beside them
    prints progress alone (and make's own line)."""
    run = make_run({**env, "MODEL": path})
    out, _ = run.communicate(timeout=120)
    assert run.returncode != 0, out
    assert "Traceback" not in out, out
    return [line for line in out.splitlines() if line.startswith("make run: ")]


def retype_first_tensor(path: str, kind: int) -> None:
    """The first tensor's type field rewritten in place (tensor info: name, dims, type, offset)."""
    tensor = gguf.GGUFReader(path).tensors[0]
    name_bytes = len(tensor.name.encode())
    at = tensor.field.offset + 8 + name_bytes + 4 + 8 * len(tensor.shape)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(int(kind).to_bytes(4, "little"))


def test_bad_files_get_one_line_naming_the_file_and_what_is_wrong(env, tmp_path):
    kinds = CASES["llama"][1]
    truncated = write_tiny_gguf(str(tmp_path / "truncated.gguf"), "llama", kinds)
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    [line] = refusal(env, truncated)
    assert truncated in line and "truncated" in line

    unknown_arch = write_tiny_gguf(str(tmp_path / "arch.gguf"), "mamba", kinds)
    [line] = refusal(env, unknown_arch)
    assert unknown_arch in line and "mamba" in line

    unknown_type = write_tiny_gguf(str(tmp_path / "type.gguf"), "llama", kinds)
    retype_first_tensor(unknown_type, 99)
    [line] = refusal(env, unknown_type)
    assert unknown_type in line and "type 99" in line


def test_a_tensor_shape_that_disagrees_with_the_metadata_is_refused(env, tmp_path):
    path = write_tiny_gguf(
        str(tmp_path / "shape.gguf"), "llama", {**CASES["llama"][1], "ffn": T.F32}
    )
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["llama.feed_forward_length"].parts[-1][0] = 384  # the tensors hold 512
    del reader
    [line] = refusal(env, path)
    assert path in line and "mlp.gate_proj" in line, line
