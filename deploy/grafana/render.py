"""The Grafana dashboards of deploy/grafana/, written from the panels listed here, and the same
dashboards as a ConfigMap for the Kubernetes render (deploy/k8s/base/grafana-dashboards.yaml,
labelled `grafana_dashboard: "1"` for Grafana's dashboard sidecar).

`python -m deploy.grafana.render` rewrites both; tests/unit/test_grafana_dashboards.py fails when
they differ from this file, parses every query, and tests/e2e/test_docs_commands.py checks every
metric named is on a live stack's /metrics.

Every metric is one the stack exports (services/gateway/metrics.py, services/gateway/restarts.py,
services/worker/metrics.py, services/kvcache/metrics.py). The gateway and the workers both
export `tandem:num_requests_waiting` and `_running`; a query picks the gateway's series as those
of an instance that also exports `tandem:request_queue_time_seconds_count`, which only the
gateway does. A Mooncake pool exports no series of tandem's: its hits are counted by the gateway
from the replies' usage (`tandem:prompt_tokens_cached_by_tier`, as `cached_tokens_by_tier`)."""

from __future__ import annotations

import json
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGMAP = os.path.join(HERE, "..", "k8s", "base", "grafana-dashboards.yaml")
RATE = "[$__rate_interval]"
GATEWAY = "group by (instance) (tandem:request_queue_time_seconds_count)"


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    labels = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{RATE})))",
            f"{legend}p{int(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def ratio(hits: str, total: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({hits}{RATE})) / sum{group} (rate({total}{RATE}))"


# (row, [(title, unit, [(PromQL, legend)])]): a row a question an operator asks.
OVERVIEW = [
    (
        "Traffic and errors",
        [
            (
                "Requests finished, by finish reason",
                "reqps",
                [
                    (
                        f"sum by (finished_reason) (rate(tandem:request_success_total{RATE}))",
                        "{{finished_reason}}",
                    )
                ],
            ),
            (
                "Requests, by API surface and status",
                "reqps",
                [
                    (
                        f"sum by (surface, status) (rate(tandem:requests_total{RATE}))",
                        "{{surface}} {{status}}",
                    )
                ],
            ),
            (
                "Errors, by status code",
                "reqps",
                [(f"sum by (code) (rate(tandem:request_errors_total{RATE}))", "{{code}}")],
            ),
            (
                "Refused, by API surface and HTTP status",
                "reqps",
                [
                    (
                        f"sum by (surface, status) (rate(tandem:requests_refused_total{RATE}))",
                        "{{surface}} {{status}}",
                    )
                ],
            ),
            (
                "Calls refused, by API key and reason",
                "reqps",
                [
                    (
                        f"sum by (key, reason) (rate(tandem:api_key_rejected_total{RATE}))",
                        "{{key}} {{reason}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Latency and throughput",
        [
            ("Time to first token", "s", quantiles("tandem:time_to_first_token_seconds")),
            (
                "Time per output token",
                "s",
                quantiles("tandem:request_time_per_output_token_seconds"),
            ),
            ("Inter-token latency", "s", quantiles("tandem:inter_token_latency_seconds")),
            (
                "Tokens per second",
                "short",
                [
                    (f"sum(rate(tandem:generation_tokens_total{RATE}))", "output"),
                    (f"sum(rate(tandem:prompt_tokens_total{RATE}))", "prompt"),
                    (f"sum(rate(tandem:prompt_tokens_cached_total{RATE}))", "prompt, cached"),
                ],
            ),
            ("Engine step", "s", quantiles("tandem:engine_step_seconds")),
        ],
    ),
    (
        "Queues and tenants",
        [
            (
                "Admission queue, by API key",
                "short",
                [
                    (
                        f"sum by (key) (tandem:num_requests_waiting and on (instance) {GATEWAY})",
                        "{{key}}",
                    )
                ],
            ),
            (
                "Time queued, by API key",
                "s",
                quantiles("tandem:request_queue_time_seconds", by="key")[1:],
            ),
            (
                "Requests running and waiting, per worker",
                "short",
                [
                    (
                        f"tandem:num_requests_running unless on (instance) {GATEWAY}",
                        "running {{instance}}",
                    ),
                    (
                        f"tandem:num_requests_waiting unless on (instance) {GATEWAY}",
                        "waiting {{instance}}",
                    ),
                ],
            ),
            (
                "Output tokens per second, by API key",
                "short",
                [
                    (
                        f'sum by (key) (rate(tandem:api_key_tokens_total{{kind="completion"}}{RATE}))',
                        "{{key}}",
                    )
                ],
            ),
        ],
    ),
    (
        "KV cache",
        [
            (
                "KV blocks in use, per worker",
                "percentunit",
                [("tandem:kv_cache_usage_perc", "{{instance}}")],
            ),
            (
                "Prefix hit ratio, by tier",
                "percentunit",
                [
                    (
                        ratio(
                            "tandem:prefix_cache_hits_total", "tandem:prefix_cache_queries_total"
                        ),
                        "worker prefix cache",
                    ),
                    (
                        f"sum by (tier) (rate(tandem:kv_store_hits_total{RATE})) / (sum by (tier) "
                        f"(rate(tandem:kv_store_hits_total{RATE})) + sum by (tier) "
                        f"(rate(tandem:kv_store_misses_total{RATE})))",
                        "store {{tier}}",
                    ),
                    (
                        ratio("tandem:prompt_tokens_cached_total", "tandem:prompt_tokens_total"),
                        "all prompt tokens not computed",
                    ),
                    (
                        f"sum by (tier) (rate(tandem:prompt_tokens_cached_by_tier_total{RATE})) "
                        f"/ ignoring (tier) group_left sum (rate(tandem:prompt_tokens_total{RATE}))",
                        "prompt tokens from {{tier}}",
                    ),
                ],
            ),
            (
                "KV store held, by tier",
                "bytes",
                [("sum by (tier) (tandem:kv_store_bytes)", "{{tier}}")],
            ),
            (
                "KV store evictions and failures",
                "ops",
                [
                    (
                        f"sum by (tier) (rate(tandem:kv_store_evictions_total{RATE}))",
                        "evicted {{tier}}",
                    ),
                    (
                        f"sum by (call, reason) (rate(tandem:kv_store_failures_total{RATE}))",
                        "failed {{call}} {{reason}}",
                    ),
                    (
                        f"sum by (reason) (rate(tandem:kv_store_writes_dropped_total{RATE}))",
                        "write dropped {{reason}}",
                    ),
                ],
            ),
        ],
    ),
    (
        "Speculation and transfers",
        [
            (
                "Speculative acceptance",
                "percentunit",
                [
                    (
                        ratio(
                            "tandem:spec_decode_num_accepted_tokens",
                            "tandem:spec_decode_num_draft_tokens",
                        ),
                        "draft tokens kept",
                    )
                ],
            ),
            (
                "KV transfers, prefill to decode",
                "Bps",
                [
                    (
                        f"sum by (direction) (rate(tandem:kv_transfer_bytes_total{RATE}))",
                        "{{direction}}",
                    )
                ],
            ),
            (
                "KV transfer time",
                "s",
                quantiles("tandem:kv_transfer_seconds", by="direction"),
            ),
            (
                "KV store blocks stored",
                "ops",
                [(f"sum(rate(tandem:kv_store_puts_total{RATE}))", "puts")],
            ),
        ],
    ),
    (
        "Restarts",
        [
            (
                "Processes restarted by make run, by role",
                "short",
                [
                    (
                        "sum by (role) (increase(tandem:process_restarts_total[$__range]))",
                        "{{role}}",
                    )
                ],
            ),
        ],
    ),
]


def dashboard(uid: str, title: str, rows: list) -> dict:
    panels, y, panel_id = [], 0, 1
    for row, row_panels in rows:
        panels.append(
            {"type": "row", "title": row, "id": panel_id, "collapsed": False,
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )  # fmt: skip
        panel_id, y = panel_id + 1, y + 1
        for i, (name, unit, queries) in enumerate(row_panels):
            panels.append(
                {
                    "type": "timeseries",
                    "title": name,
                    "id": panel_id,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                    "targets": [
                        {
                            "refId": chr(ord("A") + n),
                            "datasource": {"type": "prometheus", "uid": "${datasource}"},
                            "expr": expr,
                            "legendFormat": legend,
                        }
                        for n, (expr, legend) in enumerate(queries)
                    ],
                }
            )
            panel_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": uid,
        "title": title,
        "tags": ["tandem"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },  # fmt: skip
        "panels": panels,
    }


DASHBOARDS = {"tandem-overview.json": dashboard("tandem-overview", "tandem: overview", OVERVIEW)}


def configmap() -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tandem-grafana-dashboards", "labels": {"grafana_dashboard": "1"}},
        "data": {name: as_json(board) for name, board in DASHBOARDS.items()},
    }
    return (
        "# Written by `python -m deploy.grafana.render` from deploy/grafana/: do not edit by hand.\n"
        '# Grafana\'s dashboard sidecar loads every ConfigMap labelled grafana_dashboard: "1".\n'
        + yaml.dump(doc, Dumper=_BlockStrings, sort_keys=False, width=120)
    )


class _BlockStrings(yaml.SafeDumper):
    """Multi-line strings (the dashboards' JSON) as literal blocks, readable in the file."""


_BlockStrings.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def as_json(board: dict) -> str:
    return json.dumps(board, indent=2) + "\n"


def main() -> int:
    for name, board in DASHBOARDS.items():
        with open(os.path.join(HERE, name), "w") as f:
            f.write(as_json(board))
    with open(CONFIGMAP, "w") as f:
        f.write(configmap())
    print(f"wrote {', '.join(DASHBOARDS)} and {os.path.relpath(CONFIGMAP)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
