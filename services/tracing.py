"""OpenTelemetry traces, configured by the standard `OTEL_*` environment variables.

Off unless an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and `OTEL_SDK_DISABLED` is not true; then spans go
to it in batches, over gRPC or HTTP (`OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`: `grpc`, the
default, or `http/protobuf`). `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` name the
process. The context crosses processes as W3C `traceparent` in gRPC metadata (and in HTTP
headers at the gateway), so one request gives one trace.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from opentelemetry import context, propagate, trace

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem")
_provider = None


def enabled_by_environment() -> bool:
    env = os.environ.get
    if (env("OTEL_SDK_DISABLED") or "").lower() == "true" or env("OTEL_TRACES_EXPORTER") == "none":
        return False
    return bool(env("OTEL_EXPORTER_OTLP_ENDPOINT") or env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(service_name: str) -> None:
    """Installs the exporting tracer provider when the environment asks for one."""
    global _provider
    if not enabled_by_environment():
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    log.info("tracing on: spans go to OTLP (%s)", protocol or "grpc")


def shutdown() -> None:
    """Flushes spans not yet exported."""
    if _provider is not None:
        _provider.shutdown()


def inject(ctx: context.Context | None = None) -> list[tuple[str, str]]:
    """A trace context (default: the current one) as gRPC metadata; empty when not tracing."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return sorted(carrier.items())


def start_span(
    name: str, parent: context.Context | None = None, **attributes
) -> tuple[trace.Span, context.Context]:
    """A span and the context that has it as parent, for code that cannot hold a `with` block
    open (an async generator may resume in another task, where the current context differs).
    The caller ends the span."""
    span = tracer.start_span(
        name, context=parent, attributes={f"tandem.{k}": v for k, v in attributes.items()}
    )
    return span, trace.set_span_in_context(span, parent)


def extract(metadata: Iterable[tuple[str, str]] | None) -> context.Context:
    """The caller's trace context from gRPC metadata or HTTP headers."""
    return propagate.extract({k.lower(): v for k, v in (metadata or ())})
