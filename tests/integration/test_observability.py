"""Metrics and traces from real processes: every service's /metrics parses as Prometheus text
and its counters move as requests flow; one disaggregated request gives one trace with spans
from the gateway, the prefill process and the decode process (an in-process OTLP receiver)."""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent import futures

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from deploy.processes import named_address
from deploy.stack import start_stack

HANG_GUARD_S = 30


def scrape(address: str) -> dict[str, float]:
    """Every sample of a /metrics page, by name and labels."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_parse_and_move_on_gateway_envoy_and_worker(services_stack):
    stack = services_stack.processes
    worker = named_address(stack.worker_processes[stack.workers["both"][0]], "metrics")
    before_gateway, before_worker = scrape(stack.openai_address), scrape(worker)
    client = openai.OpenAI(
        base_url=f"http://{stack.envoy_address}/v1", api_key="-", max_retries=0, timeout=30
    )
    model = client.models.list().data[0].id
    for _ in range(2):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "the fox " * 10}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
    gateway, via_envoy, after_worker = (
        scrape(stack.openai_address),
        scrape(stack.envoy_address),
        scrape(worker),
    )

    def moved(after, before, name, by=None):
        delta = after.get(name, 0) - before.get(name, 0)
        return delta == by if by is not None else delta > 0

    assert moved(
        gateway, before_gateway, "tandem:request_success_total[('finished_reason', 'length')]", by=2
    )
    assert moved(
        gateway,
        before_gateway,
        "tandem:requests_total[('status', 'ok'), ('surface', 'chat.completions')]",
        by=2,
    )
    # the second prompt's hit, counted by where it came from: here, the worker's own cache
    cached = "tandem:prompt_tokens_cached_total[]"
    assert gateway[cached] > before_gateway.get(cached, 0)
    assert moved(
        gateway,
        before_gateway,
        "tandem:prompt_tokens_cached_by_tier_total[('tier', 'local')]",
        by=gateway[cached] - before_gateway.get(cached, 0),
    )
    assert moved(gateway, before_gateway, "tandem:time_to_first_token_seconds_count[]", by=2)
    assert moved(gateway, before_gateway, "tandem:request_generation_tokens_sum[]", by=10)
    routed = sum(
        v - before_gateway.get(k, 0)
        for k, v in gateway.items()
        if k.startswith("tandem:routing_decisions_total[('policy', 'kv:both')")
    )
    assert routed == 2
    assert moved(gateway, before_gateway, "tandem:inter_token_latency_seconds_count[]", by=8)
    assert (
        "tandem:num_requests_waiting[('key', '')]" in via_envoy
    )  # the gateway's page, through Envoy
    assert moved(
        after_worker, before_worker, "tandem:worker_requests_total[('outcome', 'length')]", by=2
    )
    # the second prompt hit
    assert moved(after_worker, before_worker, "tandem:prefix_cache_hits_total[]")
    assert moved(after_worker, before_worker, "tandem:engine_step_seconds_count[]")
    assert after_worker["tandem:kv_blocks_free[]"] + after_worker["tandem:kv_blocks_used[]"] > 0


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver: keeps every span with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def otlp_receiver():
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(0)


def test_one_disaggregated_request_gives_one_trace_across_three_processes(
    chat_checkpoint, otlp_receiver
):
    receiver, endpoint = otlp_receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    stack = start_stack(
        str(chat_checkpoint),
        topology="disaggregated",
        worker_args=("--kv-cache-bytes", str(8 << 20)),
        worker_env={"prefill": env, "decode": env},
        gateway_env=env,
    )
    try:
        client = openai.OpenAI(
            base_url=f"http://{stack.envoy_address}/v1", api_key="-", max_retries=0, timeout=30
        )
        # the caller's own trace
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            max_tokens=8,
            messages=[{"role": "user", "content": "the fox"}],
            extra_body={"ignore_eos": True},
            extra_headers={"traceparent": traceparent},
        )
        wanted = {
            ("tandem-gateway", "chat.completions"),
            ("tandem-gateway", "admission"),
            ("tandem-gateway", "route"),
            ("tandem-prefill", "prefill"),
            ("tandem-prefill", "kv_transfer"),
            ("tandem-decode", "decode"),
        }
        deadline = time.monotonic() + HANG_GUARD_S
        while not wanted <= {(service, span.name) for service, span in receiver.spans}:
            assert time.monotonic() < deadline, (
                f"spans seen: {sorted({(s, x.name) for s, x in receiver.spans})}"
            )
            time.sleep(0.1)
    finally:
        stack.stop()
    ours = [(service, span) for service, span in receiver.spans if (service, span.name) in wanted]
    assert {span.trace_id.hex() for _, span in ours} == {"0af7651916cd43dd8448eb211c80319c"}
    by_name = {span.name: span for _, span in ours}
    assert by_name["chat.completions"].parent_span_id.hex() == "b7ad6b7169203331"
    # The workers' spans hang under the gateway's; the transfer says how many bytes moved.
    gateway_ids = {span.span_id for service, span in receiver.spans if service == "tandem-gateway"}
    assert (
        by_name["prefill"].parent_span_id in gateway_ids
        and by_name["decode"].parent_span_id in gateway_ids
    )
    attributes = {a.key: a.value.int_value for a in by_name["kv_transfer"].attributes}
    assert attributes["tandem.kv_bytes"] > 0
    route = {
        a.key: a.value.string_value for s in ours if s[1].name == "route" for a in s[1].attributes
    }
    assert route["tandem.worker"] in stack.workers["prefill"] + stack.workers["decode"]
