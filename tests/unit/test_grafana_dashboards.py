"""The Grafana dashboards (deploy/grafana/): the committed JSON and the Kubernetes ConfigMap are
what deploy/grafana/render.py writes, and every panel's PromQL parses (promql-parser, Prometheus'
grammar) once Grafana's variables are set, naming only tandem's metrics. That each metric is on
a live stack's /metrics is tests/e2e/test_docs_commands.py's check."""

from __future__ import annotations

import json
import os

import promql_parser
import pytest

from deploy.grafana import render

# Grafana's variables as a query is sent: a range in place of the interval ones.
VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}


def queries(board: dict) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL query selects (raises ValueError if it does not parse)."""
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    names: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
            return
        for attr in ("expr", "lhs", "rhs", "vector_selector", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for arg in getattr(node, "args", None) or []:
            walk(arg)

    walk(promql_parser.parse(expr))
    return names


def dashboard_metrics() -> dict[str, set[str]]:
    """Metric name -> the panels that use it, over every dashboard file."""
    used: dict[str, set[str]] = {}
    for name in render.DASHBOARDS:
        with open(os.path.join(render.HERE, name)) as f:
            for title, expr in queries(json.load(f)):
                for metric in metric_names(expr):
                    used.setdefault(metric, set()).add(title)
    return used


def test_the_files_are_what_render_writes():
    for name, board in render.DASHBOARDS.items():
        with open(os.path.join(render.HERE, name)) as f:
            assert f.read() == render.as_json(board), (
                f"run python -m deploy.grafana.render ({name})"
            )
    with open(render.CONFIGMAP) as f:
        assert f.read() == render.configmap(), "run python -m deploy.grafana.render (the ConfigMap)"


@pytest.mark.parametrize("name", list(render.DASHBOARDS))
def test_every_panel_query_parses_and_names_tandem_metrics(name):
    with open(os.path.join(render.HERE, name)) as f:
        board = json.load(f)
    found = queries(board)
    assert len(found) > 20
    for title, expr in found:
        names = metric_names(expr)
        assert names, f"{title}: {expr} selects no metric"
        assert all(n.startswith("tandem:") for n in names), (title, names)


def test_the_scan_finds_every_selector_and_a_bad_query_fails():
    expr = (
        "histogram_quantile(0.9, sum by (le) (rate(a_bucket[$__rate_interval]))) "
        "/ on (instance) group by (instance) (b) + -c offset 5m"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}
    with pytest.raises(ValueError):
        metric_names("sum by (le (rate(a[5m]))")


def test_the_overview_covers_what_operators_look_at():
    used = dashboard_metrics()
    for metric in (
        "tandem:request_success_total",
        "tandem:requests_refused_total",
        "tandem:time_to_first_token_seconds_bucket",
        "tandem:request_time_per_output_token_seconds_bucket",
        "tandem:generation_tokens_total",
        "tandem:num_requests_waiting",
        "tandem:request_queue_time_seconds_bucket",
        "tandem:kv_cache_usage_perc",
        "tandem:kv_store_hits_total",
        "tandem:spec_decode_num_accepted_tokens",
        "tandem:kv_transfer_bytes_total",
        "tandem:process_restarts_total",
    ):
        assert metric in used, metric
