"""`make run`'s launcher on a checkpoint: the whole stack answers like the engine, and Ctrl-C
stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest

from deploy.processes import REPO_ROOT, free_port
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


@pytest.mark.parametrize(
    "topology, workers, num_workers",
    [
        ("colocated", {"WORKERS": "2"}, 2),
        ("disaggregated", {"PREFILL": "2", "DECODE": "1"}, 3),
    ],
)
def test_launcher_serves_the_engines_greedy_output_and_stops_cleanly(
    chat_checkpoint, topology, workers, num_workers
):
    port = free_port()
    env = {
        **os.environ,
        "MODEL": str(chat_checkpoint),
        "PORT": str(port),
        "TOPOLOGY": topology,
        **workers,
    }
    launcher = subprocess.Popen(
        [sys.executable, "deploy/launch.py"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        lines = []
        while not any("tandem is ready" in line for line in lines):
            assert time.monotonic() < deadline and launcher.poll() is None, "".join(lines)
            lines.append(launcher.stdout.readline())
        assert f"; {topology}: " in lines[-1]
        children = psutil.Process(launcher.pid).children(recursive=True)
        assert len(children) >= num_workers + 2  # the workers, the gateway, Envoy

        tokenizer = Tokenizer(str(chat_checkpoint))
        messages = [{"role": "user", "content": "the lazy dog"}]
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
        [expected] = LLMEngine(
            EngineConfig(model=str(chat_checkpoint), kv_cache_bytes=8 << 20)
        ).generate([prompt], SamplingParams(max_tokens=16, temperature=0))
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30
        )
        for _ in range(2):  # equal loads alternate: both (prefill) workers give the same answer
            reply = client.chat.completions.create(
                model=chat_checkpoint.name, messages=messages, max_tokens=16, temperature=0
            )
            assert reply.choices[0].message.content == tokenizer.decode(expected.token_ids)
    finally:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0
    assert not any(
        child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children
    )


def run_launcher(env_overrides: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PORT": str(free_port()), **env_overrides}
    return subprocess.run(
        [sys.executable, "deploy/launch.py"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unsupported_model_fails_with_one_line_naming_the_cause(chat_checkpoint, tmp_path):
    import json
    import shutil

    folder = tmp_path / "a-falcon-model"
    shutil.copytree(chat_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "architectures": ["FalconForCausalLM"]})
    )
    result = run_launcher({"MODEL": str(folder)})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("make run: worker failed to start: ") and "unsupported architecture" in last
    )
    assert "FalconForCausalLM" in last


def test_a_taken_port_fails_with_one_line_naming_it(chat_checkpoint):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_launcher({"MODEL": str(chat_checkpoint), "PORT": str(port)})
    assert result.returncode == 1
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"make run: port {port} on 127.0.0.1 is already taken; pick another with PORT="
    )


def test_a_port_whose_listener_just_stopped_is_free_and_a_live_one_is_not():
    import socket

    from deploy.launch import port_is_free

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Envoy's listeners are
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    assert not port_is_free("127.0.0.1", port)  # listening
    served.close()  # the server side closes first: its socket waits in TIME_WAIT on the port
    listener.close()
    client.close()
    time.sleep(0.1)
    assert port_is_free("127.0.0.1", port)


@pytest.mark.parametrize(
    "setting, value, line",
    [
        ("KV_STORE", "yes", "make run: KV_STORE=yes is not one of off, on, mooncake"),
        ("TOPOLOGY", "split", "make run: TOPOLOGY=split is not one of colocated, disaggregated"),
        ("KV_TRANSPORT", "rdma", "make run: KV_TRANSPORT=rdma is not one of ucx, tcp, mooncake"),
        ("ROUTER", "random", "make run: ROUTER=random is not one of kv, load, round_robin"),
        (
            "SPECULATIVE",
            "medusa",
            "make run: SPECULATIVE=medusa is not one of off, ngram, draft, eagle3",
        ),
        (
            "REASONING_PARSER",
            "o1",
            "make run: REASONING_PARSER=o1 is not one of deepseek_r1, qwen3, kimi_k2, openai_gptoss, none",
        ),
        ("PUBLIC_METRICS", "yes", "make run: PUBLIC_METRICS=yes is not one of 0, 1"),
        ("DTYPE", "bf16", "make run: DTYPE=bf16 is not one of auto, float32, bfloat16, float16"),
        ("WORKERS", "two", "make run: WORKERS=two is not a positive whole number"),
    ],
)
def test_a_setting_value_make_run_does_not_know_is_refused_with_one_line(
    chat_checkpoint, setting, value, line
):
    result = run_launcher({"MODEL": str(chat_checkpoint), setting: value})
    assert result.returncode == 2
    assert result.stderr.strip() == line
    assert "tandem is ready" not in result.stdout


def test_every_enumerated_setting_has_its_values_and_a_parser_name_is_known():
    from deploy.run_settings import enumerated, refusal

    assert all(values for values in enumerated().values())
    assert refusal({"TOOL_CALL_PARSER": "hermes", "KV_STORE": "on", "WORKERS": "2"}) is None
    assert refusal({"TOOL_CALL_PARSER": "hermes2"}).startswith(
        "make run: TOOL_CALL_PARSER=hermes2 is not one of hermes, "
    )


def test_kv_store_mooncake_runs_a_master_and_two_nodes_and_serves_one_workers_prefix_to_another(
    chat_checkpoint,
):
    port = free_port()
    env = {
        **os.environ,
        "MODEL": str(chat_checkpoint),
        "PORT": str(port),
        "WORKERS": "2",
        "ROUTER": "round_robin",  # the prompt's second request goes to the other worker
        "KV_STORE": "mooncake",
        "KV_STORE_DRAM_BYTES": str(64 << 20),
        "KV_CACHE_BYTES": str(8 << 20),
    }
    launcher = subprocess.Popen(
        [sys.executable, "deploy/launch.py"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        lines = []
        while not any("tandem is ready" in line for line in lines):
            assert time.monotonic() < deadline and launcher.poll() is None, "".join(lines)
            lines.append(launcher.stdout.readline())
        children = psutil.Process(launcher.pid).children(recursive=True)
        commands = [" ".join(child.cmdline()) for child in children]
        assert sum("mooncake_master" in c for c in commands) == 1
        assert sum("services.kvcache.mooncake_node" in c for c in commands) == 2
        # make run's nodes have disk tiers (KV_STORE_DISK_BYTES, 4 GiB), the master offloads
        assert all("--disk-bytes" in c for c in commands if "mooncake_node" in c)
        assert any("--enable_offload=true" in c for c in commands if "mooncake_master" in c)

        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30
        )
        prompt = [(i * 13) % 370 + 3 for i in range(10 * 16 + 5)]  # 10 full blocks

        def complete():
            return client.completions.create(
                model=chat_checkpoint.name, prompt=prompt, max_tokens=8, temperature=0
            )

        first = complete()
        # Round robin alternates; the write-through lands after the first reply.
        while True:
            reply = complete()
            tiers = reply.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
            if tiers["mooncake_dram"]:
                break
            assert time.monotonic() < deadline, tiers
        assert tiers == {
            "local": 0,
            "store_dram": 0,
            "store_disk": 0,
            "mooncake_dram": 160,
            "mooncake_disk": 0,
        }
        assert reply.choices[0].text == first.choices[0].text
    finally:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0
    assert not any(
        child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children
    )
