"""Envoy's rendered config (deploy/envoy): Envoy itself accepts it, and it carries the edge
limits (connection cap, buffer limits, idle and headers timeouts, HTTP/2 stream and window
limits) with their defaults or the values given, and marks every request as public."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from deploy.envoy import render as envoy_render


def rendered(**limits) -> dict:
    return yaml.safe_load(
        envoy_render.render(18080, 19901, "127.0.0.1:9000", "127.0.0.1:8000", **limits)
    )


def connection_manager(config: dict) -> dict:
    [listener] = config["static_resources"]["listeners"]
    [chain] = listener["filter_chains"]
    return chain["filters"][0]["typed_config"]


def test_envoy_accepts_the_config(tmp_path):
    path = tmp_path / "envoy.yaml"
    path.write_text(envoy_render.render(18080, 19901, "127.0.0.1:9000", "127.0.0.1:8000"))
    result = subprocess.run(
        [envoy_render.envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_edge_limits_default_to_the_documented_values():
    config = rendered()
    [monitor] = config["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert (
        monitor["typed_config"]["max_active_downstream_connections"]
        == envoy_render.MAX_CONNECTIONS
        == 16384
    )
    [listener] = config["static_resources"]["listeners"]
    assert listener["per_connection_buffer_limit_bytes"] == 32768
    for cluster in config["static_resources"]["clusters"]:
        assert cluster["per_connection_buffer_limit_bytes"] == 32768, cluster["name"]
    hcm = connection_manager(config)
    assert hcm["common_http_protocol_options"]["idle_timeout"] == "60s"
    assert hcm["request_headers_timeout"] == "10s"
    assert hcm["use_remote_address"] is True
    assert hcm["http2_protocol_options"] == {
        "max_concurrent_streams": 100,
        "initial_stream_window_size": 65536,
        "initial_connection_window_size": 1048576,
    }
    [edge_mark] = hcm["route_config"]["request_headers_to_add"]
    assert edge_mark["header"] == {"key": "x-tandem-edge", "value": "public"}
    assert edge_mark["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"  # a client cannot unset it


def test_the_limits_given_are_the_limits_rendered():
    config = rendered(max_connections=5, idle_timeout_s=0.5, headers_timeout_s=2)
    [monitor] = config["overload_manager"]["resource_monitors"]
    assert monitor["typed_config"]["max_active_downstream_connections"] == 5
    hcm = connection_manager(config)
    assert hcm["common_http_protocol_options"]["idle_timeout"] == "0.5s"
    assert hcm["request_headers_timeout"] == "2s"


@pytest.mark.parametrize(
    "limits", [{"max_connections": 0}, {"idle_timeout_s": 0}, {"headers_timeout_s": -1}]
)
def test_a_limit_that_would_refuse_everything_is_an_error(limits):
    with pytest.raises(ValueError, match="connection cap"):
        rendered(**limits)
