"""gpt-oss as OpenAI publishes it (MXFP4 experts, sinks, sliding layers: tests/tiny_models.py),
served through `make run MODEL=`: a folder without tokenizer files reads o200k_harmony, and a
completion of token ids answers with transformers' greedy tokens and logprobs on the same
weights (transformers dequantizing the blocks itself)."""

from __future__ import annotations

import os

import openai
import torch

from engine.tokenizer import Tokenizer
from tests.e2e.test_published_checkpoints import served

STEPS = 8


def test_make_run_serves_transformers_tokens_and_logprobs(hf_checkpoint):
    reference, folder = hf_checkpoint("gpt_oss")
    # past the window of 8
    assert_serves_transformers_greedy(reference, folder, [5, 17, 101, 33, 250, 7, 81, 40, 41, 42])


def assert_serves_transformers_greedy(reference, folder: str, prompt: list[int]) -> None:
    """make run on `folder` completes the token ids `prompt` with `reference`'s greedy tokens
    and per-step logprobs (within 1e-4)."""
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
    with served(folder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        [choice] = client.completions.create(
            model=os.path.basename(folder),
            prompt=prompt,
            max_tokens=STEPS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        ).choices
    assert choice.text == Tokenizer(folder).decode(tokens)
    torch.testing.assert_close(
        torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float64),
        torch.tensor(logprobs, dtype=torch.float64),
        rtol=0,
        atol=1e-4,
    )
