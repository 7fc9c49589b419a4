"""Codex CLI against gpt-oss through `make run`: two turns of the real client, the second read
from the prompt cache.

    .venv/bin/python bench/codex_gpt_oss.py [--codex /tmp/codex/node_modules/.bin/codex]
                                            [--keep DIR]

Needs Codex CLI from npm (`npm install @openai/codex` in a scratch folder, e.g. /tmp/codex).
Builds a tiny gpt-oss checkpoint in OpenAI's published layout (tests/tiny_models.py: MXFP4
experts, sinks, a sliding layer then a full one, YaRN to 131,072 positions, the o200k_harmony
vocabulary read offline), rigged so that whatever Codex's ~7,500-token prompt holds, the model
reasons and answers the question it ends with in harmony (TURNS): the full layer's output
projection and experts' down projection are zero, so the last hidden state is a function of the
sliding layer's window, the last 8 tokens (the question's tail, then the reply's own), and
lm_head is the least squares map from those states to the replies' next tokens, checked with
transformers on the MXFP4 folder behind another prompt. Then `make run MODEL=<folder>`
(deploy/launch.py), a CODEX_HOME whose provider has `wire_api = "responses"` at its /v1 (no
key), and

    codex exec --json --skip-git-repo-check "What is 2+2?"
    codex exec --json --skip-git-repo-check resume --last "And what is 3+3?"

Prints each turn's outcome (turn.completed, or the error), its final message, its own usage
(from Codex's session files: on resume, turn.completed's usage is the thread's total) and
turn.completed's; exits 1 when a turn fails, answers other than rigged (the prompt's tail was
not the question as harmony renders it), or the second reads nothing from the cache. `--keep
DIR` keeps the checkpoint, CODEX_HOME (Codex's session files) and the launcher's log there.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from deploy.processes import REPO_ROOT, free_port

MODEL_NAME = "gpt-oss-tiny"
# Each question, and the reply the model is rigged to write after it, in harmony.
TURNS = {
    "What is 2+2?": "<|channel|>analysis<|message|>2+2 is 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>4<|return|>",
    "And what is 3+3?": "<|channel|>analysis<|message|>3+3 is 6.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>6<|return|>",
}


def rig_replies(model, cases: list[tuple[list[int], list[int]]], margin: float = 30.0) -> None:
    """Sets lm_head so that greedy decoding after each prompt writes its reply: the least squares
    map from the final hidden states at the replies' positions to their next tokens (as
    tests/tiny_models.py's rig_reply does for one prompt)."""
    import torch

    with torch.no_grad():
        hidden, tokens = [], []
        for prompt, reply in cases:
            states = model.model(torch.tensor([prompt + reply[:-1]])).last_hidden_state
            hidden.append(states[0, len(prompt) - 1 :].double())  # [len(reply), hidden]
            tokens += reply
        targets = sorted(set(tokens))
        wanted = torch.zeros(len(tokens), len(targets), dtype=torch.float64)
        wanted[range(len(tokens)), [targets.index(t) for t in tokens]] = margin
        rows = torch.linalg.lstsq(torch.cat(hidden), wanted).solution.T  # [targets, hidden]
        model.lm_head.weight.zero_()
        model.lm_head.weight[targets] = rows.to(model.lm_head.weight.dtype)


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def rigged_checkpoint(folder: str) -> None:
    """The rigged gpt-oss folder (see the module docstring), checked with transformers."""
    import torch

    from engine.o200k import harmony_encoding
    from services.gateway.prepare.harmony import render
    from tests.tiny_models import build_hf_model, mxfp4_layout

    encoding = harmony_encoding()
    model = build_hf_model("gpt_oss", vocab_size=201088, max_position_embeddings=131072)
    assert model.config.layer_types[0] == "sliding_attention" and model.config.sliding_window == 8
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.self_attn.o_proj.bias.zero_()
            layer.mlp.experts.down_proj.zero_()  # zero in MXFP4 too: e2m1 code 0
            layer.mlp.experts.down_proj_bias.zero_()
    cases = [
        (
            render([{"role": "user", "content": question}], None),
            encoding.encode(reply, allowed_special="all"),
        )
        for question, reply in TURNS.items()
    ]
    rig_replies(model, cases)
    model.save_pretrained(folder)
    reference = mxfp4_layout(folder, model)
    tool = {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}
    for (_, reply), question in zip(cases, TURNS):
        # Codex's prompt in small: instructions, tools, an earlier exchange, then the question.
        prompt = render(
            [
                {"role": "system", "content": "You are a coding agent. " * 40},
                {"role": "user", "content": "<environment_context>/tmp</environment_context>"},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": question},
            ],
            [tool],
        )
        assert greedy(reference, prompt, len(reply)) == reply, f"the rig fails after {question!r}"


@contextlib.contextmanager
def make_run(folder: str, log_path: str):
    """`make run`'s launcher on `folder`, ready; its output in `log_path`; Ctrl-C after."""
    port = free_port()
    log = open(log_path, "w")
    launcher = subprocess.Popen(
        [sys.executable, "deploy/launch.py"],
        cwd=REPO_ROOT,
        env={**os.environ, "MODEL": folder, "PORT": str(port)},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while "tandem is ready" not in open(log_path).read():
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"make run did not start:\n{open(log_path).read()}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
        log.close()


def codex_home(folder: str, base_url: str) -> None:
    with open(os.path.join(folder, "config.toml"), "w") as f:
        f.write(
            f'model = "{MODEL_NAME}"\n'
            'model_provider = "tandem"\n'
            "[model_providers.tandem]\n"
            'name = "tandem"\n'
            f'base_url = "{base_url}"\n'
            'wire_api = "responses"\n'
        )


def codex_turn(codex: str, home: str, args: list[str], workdir: str) -> dict:
    """One `codex exec --json` run: its events, read for the outcome, usage and final message."""
    started = time.monotonic()
    run = subprocess.run(
        [codex, "exec", "--json", "--skip-git-repo-check", *args],
        cwd=workdir,
        env={**os.environ, "CODEX_HOME": home},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    turn = {
        "seconds": time.monotonic() - started,
        "outcome": None,
        "usage": {},
        "message": None,
    }
    for line in run.stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.get("type")
        if kind == "turn.completed":
            turn["outcome"], turn["usage"] = kind, event.get("usage") or {}
        elif kind in ("turn.failed", "error"):
            turn["outcome"] = f"{kind}: {json.dumps(event.get('error') or event.get('message'))}"
        elif kind == "item.completed" and event["item"].get("type") == "agent_message":
            turn["message"] = event["item"].get("text")
    if turn["outcome"] is None:
        turn["outcome"] = f"no outcome (exit {run.returncode}): {run.stderr.strip()[-2000:]}"
    return turn


def turn_usage(home: str) -> list[dict]:
    """Each turn's own usage, in order, from Codex's session files: its requests' usage summed
    (`turn_token_usage` of the turn's last `token_usage_record`)."""
    by_turn: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(home, "sessions", "**", "*.jsonl"), recursive=True)):
        for line in open(path):
            record = json.loads(line)
            if record.get("type") == "token_usage_record":
                payload = record["payload"]
                by_turn[payload["turn_id"]] = payload["turn_token_usage"]
    return list(by_turn.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codex", default="/tmp/codex/node_modules/.bin/codex")
    parser.add_argument("--keep", help="a folder for the checkpoint, CODEX_HOME and the log")
    args = parser.parse_args()
    if not os.access(args.codex, os.X_OK):
        raise SystemExit(f"no Codex CLI at {args.codex}: npm install @openai/codex, then --codex")
    version = subprocess.run([args.codex, "--version"], capture_output=True, text=True).stdout
    print(version.strip())
    with contextlib.ExitStack() as stack:
        root = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        folder, home, workdir = (os.path.join(root, n) for n in (MODEL_NAME, "codex", "work"))
        for path in (home, workdir):
            os.makedirs(path, exist_ok=True)
        started = time.monotonic()
        rigged_checkpoint(folder)
        print(f"rigged checkpoint built and checked in {time.monotonic() - started:.0f} s")
        base_url = stack.enter_context(make_run(folder, os.path.join(root, "make_run.log")))
        codex_home(home, base_url)
        first, second = TURNS
        turns = [
            codex_turn(args.codex, home, [first], workdir),
            codex_turn(args.codex, home, ["resume", "--last", second], workdir),
        ]
        requests = turn_usage(home)
    failed = False
    for (name, turn), (question, reply), usage in zip(
        (("first", turns[0]), ("second", turns[1])), TURNS.items(), requests + [{}, {}]
    ):
        answer = reply.rsplit("<|message|>", 1)[1].removesuffix("<|return|>")
        print(
            f"{name} turn ({question!r}): {turn['outcome']} in {turn['seconds']:.0f} s; "
            f"message {turn['message']!r}\n"
            f"  its requests: input_tokens {usage.get('input_tokens')}, "
            f"cached_input_tokens {usage.get('cached_input_tokens')}, "
            f"output_tokens {usage.get('output_tokens')} "
            f"(reasoning {usage.get('reasoning_output_tokens')})\n"
            f"  codex's turn.completed usage (the thread's total on resume): {turn['usage']}"
        )
        failed |= turn["outcome"] != "turn.completed" or turn["message"] != answer
    if not (requests[1:] and requests[1].get("cached_input_tokens")):
        print("the second turn read nothing from the cache")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
