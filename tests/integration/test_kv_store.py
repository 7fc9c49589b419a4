"""The KV cache store with real processes: a prompt computed by one worker is served from the
store to another with an empty cache (cached_tokens = its full blocks, the same greedy
output), also after the store restarts with DRAM empty (from its disk tier); a dead store
costs no request, nor does a paused or slow one, and hits resume when it is back."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from deploy.processes import start_service
from deploy.stack import start_stack
from tandem.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    kvcache_pb2,
    kvcache_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

WORKER_ARGS = ("--kv-cache-bytes", str(8 << 20))
BLOCK = 16
PROMPT = [(i * 13) % 370 + 3 for i in range(10 * BLOCK + 5)]  # 10 full blocks
HANG_GUARD_S = 30


def complete(address: str, prompt: list[int]) -> dict:
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        headers={"Content-Type": "application/json"},
        data=json.dumps(
            {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        ).encode(),
    )
    with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
        return json.load(response)


def by_tier(response: dict) -> dict:
    return response["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


def store_stats(address: str) -> kvcache_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return kvcache_pb2_grpc.KVCacheStub(channel).Stats(kvcache_pb2.StatsRequest(), timeout=5)


def store_failures(worker) -> dict[tuple[str, str], float]:
    """A worker's tandem:kv_store_failures_total by (call, reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    from deploy.processes import named_address

    page = urllib.request.urlopen(
        f"http://{named_address(worker, 'metrics')}/metrics", timeout=10
    ).read()
    return {
        (s.labels["call"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(page.decode())
        for s in f.samples
        if s.name == "tandem:kv_store_failures_total"
    }


def wait_until(predicate, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def replace_worker(stack, model: str, *args: str) -> str:
    """Kills the stack's worker and serves from a new one (with `args`), with an empty cache."""
    [old] = stack.workers["both"]
    stack.worker_processes[old].kill()
    new = stack.start_worker(
        "both",
        model,
        "--host",
        "127.0.0.1",
        *WORKER_ARGS,
        *args,
        "--kv-store",
        stack.kv_store_address,
    )
    stack.workers["both"].remove(old)
    stack.write_workers_file()

    def routable():
        with grpc.insecure_channel(stack.gateway_address) as channel:
            health = inference_pb2_grpc.InferenceStub(channel).Health(
                inference_pb2.HealthCheckRequest(), timeout=5
            )
        return {w.address for w in health.workers if w.healthy} == {new}

    wait_until(routable, "the new worker to be the only one routed to")
    return new


def assert_no_block_held(stack) -> None:
    """Every worker's blocks are free again (cached ones too are free, only evictable): nothing
    the store calls reserved was left behind."""

    def all_free():
        for address in stack.worker_addresses:
            with grpc.insecure_channel(address) as channel:
                health = worker_pb2_grpc.WorkerStub(channel).Health(
                    worker_pb2.HealthRequest(), timeout=5
                )
            if health.num_free_blocks != health.num_blocks:
                return False
        return True

    wait_until(all_free, "every KV block to be free")


@pytest.fixture
def store_dir(tmp_path):
    return str(tmp_path / "kvcache")


def test_a_new_worker_is_served_the_prefix_from_the_store_also_after_a_store_restart(
    chat_checkpoint, store_dir
):
    model = str(chat_checkpoint)
    stack = start_stack(
        model,
        worker_args=WORKER_ARGS,
        kv_store_args=("--kv-transport", "tcp", "--disk-dir", store_dir),
    )
    try:
        cold = complete(stack.openai_address, PROMPT)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_until(
            lambda: store_stats(stack.kv_store_address).dram.blocks >= 10,
            "the write-through to land",
        )

        replace_worker(stack, model)
        warm = complete(stack.openai_address, PROMPT)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK
        assert by_tier(warm) == {
            "local": 0,
            "store_dram": 10 * BLOCK,
            "store_disk": 0,
            "mooncake_dram": 0,
            "mooncake_disk": 0,
        }
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        # now in its own cache
        assert by_tier(complete(stack.openai_address, PROMPT)) == {
            "local": 10 * BLOCK,
            "store_dram": 0,
            "store_disk": 0,
            "mooncake_dram": 0,
            "mooncake_disk": 0,
        }

        # The store restarts (SIGTERM: its blocks read twice go to disk; DRAM comes back empty).
        store = stack.processes[0]
        store.terminate()
        assert store.wait(timeout=HANG_GUARD_S) == 0
        port = stack.kv_store_address.rsplit(":", 1)[1]
        restarted, _ = start_service(
            "services.kvcache", "--port", port, "--kv-transport", "tcp", "--disk-dir", store_dir
        )
        stack.processes.append(restarted)
        stats = store_stats(stack.kv_store_address)
        assert stats.dram.blocks == 0 and stats.disk.blocks >= 10

        replace_worker(stack, model)
        again = complete(stack.openai_address, PROMPT)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK
        assert by_tier(again) == {
            "local": 0,
            "store_dram": 0,
            "store_disk": 10 * BLOCK,
            "mooncake_dram": 0,
            "mooncake_disk": 0,
        }
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]
        assert store_stats(stack.kv_store_address).disk.hits >= 10
        from prometheus_client.parser import text_string_to_metric_families

        from deploy.processes import named_address

        page = urllib.request.urlopen(
            f"http://{named_address(restarted, 'metrics')}/metrics", timeout=10
        ).read()
        samples = {
            (s.name, s.labels.get("tier")): s.value
            for f in text_string_to_metric_families(page.decode())
            for s in f.samples
        }
        assert (
            samples[("tandem:kv_store_hits_total", "disk")] >= 10
            and samples[("tandem:kv_store_blocks", "disk")] >= 10
        )
    finally:
        stack.stop()


def test_two_rank_workers_share_the_store_with_one_rank_workers(chat_checkpoint, store_dir):
    """Blocks go to and come from the store in one engine's layout: a two-rank worker's serve a
    one-rank worker, whose serve a two-rank worker again (its ranks' pools filled from them)."""
    model, two_ranks = str(chat_checkpoint), ("--tensor-parallel-size", "2")
    stack = start_stack(
        model, worker_args=(*WORKER_ARGS, *two_ranks), kv_store_args=("--disk-dir", store_dir)
    )
    try:
        cold = complete(stack.openai_address, PROMPT)
        wait_until(
            lambda: store_stats(stack.kv_store_address).dram.blocks >= 10,
            "the write-through to land",
        )
        for args in ((), two_ranks):
            replace_worker(stack, model, *args)
            warm = complete(stack.openai_address, PROMPT)
            assert by_tier(warm) == {
                "local": 0,
                "store_dram": 10 * BLOCK,
                "store_disk": 0,
                "mooncake_dram": 0,
                "mooncake_disk": 0,
            }, args
            assert warm["choices"][0]["text"] == cold["choices"][0]["text"], args
        assert_no_block_held(stack)
    finally:
        stack.stop()


def test_requests_complete_with_the_store_dead(chat_checkpoint, store_dir):
    model = str(chat_checkpoint)
    stack = start_stack(model, worker_args=WORKER_ARGS, kv_store_args=("--disk-dir", store_dir))
    try:
        cold = complete(stack.openai_address, PROMPT)
        stack.processes[0].kill()  # the store
        for _ in range(
            4
        ):  # fails fast, then is skipped for a back-off: every request completes alike
            started = time.monotonic()
            reply = complete(stack.openai_address, PROMPT[:-1] + [7])
            assert reply["usage"]["completion_tokens"] == 12
            assert time.monotonic() - started < HANG_GUARD_S
        assert (
            complete(stack.openai_address, PROMPT)["choices"][0]["text"]
            == cold["choices"][0]["text"]
        )
        assert_no_block_held(stack)
    finally:
        stack.stop()


def test_a_paused_store_costs_at_most_its_deadline_then_is_skipped_and_hits_resume_when_it_is_back(
    chat_checkpoint, store_dir
):
    import os
    import signal

    model = str(chat_checkpoint)
    stack = start_stack(model, worker_args=WORKER_ARGS, kv_store_args=("--disk-dir", store_dir))
    store = stack.processes[0]
    try:
        cold = complete(stack.openai_address, PROMPT)
        # Landed before the pause: a put still queued would land on SIGCONT and pass for the resumed write-through.
        wait_until(
            lambda: store_stats(stack.kv_store_address).dram.blocks >= 10,
            "the write-through to land",
        )
        os.kill(store.pid, signal.SIGSTOP)  # alive, silent: every store call runs into its deadline
        try:
            for i in range(4):
                started = time.monotonic()
                reply = complete(stack.openai_address, PROMPT[:-1] + [20 + i])
                assert reply["usage"]["completion_tokens"] == 12
                # a load and a put deadline at most, plus the work
                assert time.monotonic() - started < 2 * 2.0 + 10
        finally:
            os.kill(store.pid, signal.SIGCONT)
        assert (
            complete(stack.openai_address, PROMPT)["choices"][0]["text"]
            == cold["choices"][0]["text"]
        )
        assert_no_block_held(stack)

        # Back: once the worker's write back-off (10 s at most) has passed, its prompts are written through again...
        other = [t + 1 for t in PROMPT]
        before = store_stats(stack.kv_store_address)

        def written_through() -> bool:  # put and held: a put's blocks land after the call counts it
            now = store_stats(stack.kv_store_address)
            held = now.dram.blocks + now.disk.blocks - before.dram.blocks - before.disk.blocks
            return now.num_puts >= before.num_puts + 10 and held >= 10

        wait_until(
            lambda: complete(stack.openai_address, other) and written_through(),
            "write-through to resume",
        )
        # ... and served to a worker that lacks them.
        replace_worker(stack, model)
        assert (
            complete(stack.openai_address, other)["usage"]["prompt_tokens_details"]["cached_tokens"]
            == 10 * BLOCK
        )
    finally:
        stack.stop()


def test_a_slow_store_costs_at_most_its_deadline(chat_checkpoint, store_dir):
    model = str(chat_checkpoint)
    # past the workers' 2 s deadline
    stack = start_stack(
        model,
        worker_args=WORKER_ARGS,
        kv_store_args=("--disk-dir", store_dir),
        kv_store_env={"TANDEM_FAULTS": "store_delay_s=5"},
    )
    try:
        first = None
        for _ in range(4):
            started = time.monotonic()
            reply = complete(stack.openai_address, PROMPT)
            assert time.monotonic() - started < 2.0 + 10  # one load deadline at most, plus the work
            first = first or reply["choices"][0]["text"]
            assert (
                reply["choices"][0]["text"] == first and reply["usage"]["completion_tokens"] == 12
            )
        assert_no_block_held(stack)
        # the cold prompt's load ran into its deadline, and the worker counted it as a timeout
        failures = store_failures(stack.worker_processes[stack.workers["both"][0]])
        assert failures.get(("load", "timeout"), 0) >= 1, failures
        assert not failures.get(("load", "error")), failures
    finally:
        stack.stop()


def test_disaggregated_with_the_store_serves_a_new_prefill_worker_the_prefix(
    chat_checkpoint, store_dir
):
    model = str(chat_checkpoint)
    stack = start_stack(
        model,
        topology="disaggregated",
        worker_args=(*WORKER_ARGS, "--kv-transport", "tcp"),
        kv_store_args=("--kv-transport", "tcp", "--disk-dir", store_dir),
    )
    try:
        cold = complete(stack.openai_address, PROMPT)
        wait_until(
            lambda: store_stats(stack.kv_store_address).dram.blocks >= 10,
            "the prefill worker's write-through",
        )
        [old] = stack.workers["prefill"]
        stack.worker_processes[old].kill()
        new = stack.start_worker(
            "prefill",
            model,
            "--host",
            "127.0.0.1",
            *WORKER_ARGS,
            "--kv-transport",
            "tcp",
            "--kv-store",
            stack.kv_store_address,
        )
        stack.workers["prefill"].remove(old)
        stack.write_workers_file()

        def routable():
            with grpc.insecure_channel(stack.gateway_address) as channel:
                health = inference_pb2_grpc.InferenceStub(channel).Health(
                    inference_pb2.HealthCheckRequest(), timeout=5
                )
            return {w.address for w in health.workers if w.healthy and w.role == "prefill"} == {new}

        wait_until(routable, "the new prefill worker")
        warm = complete(stack.openai_address, PROMPT)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK
        assert by_tier(warm) == {
            "local": 0,
            "store_dram": 10 * BLOCK,
            "store_disk": 0,
            "mooncake_dram": 0,
            "mooncake_disk": 0,
        }
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    finally:
        stack.stop()
