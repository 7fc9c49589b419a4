"""bench/charts.py: each chart kind draws a readable PNG from a tiny figures dict, and its JSON
draws the same chart again (`python bench/charts.py FIGURES.json`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import charts
from deploy.processes import REPO_ROOT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SERVING_REPORT = {
    "dataset": "random",
    "input_len": 256,
    "output_len": 64,
    "served_model_name": "tandem-demo",
    "topology": "colocated x1",
    "cpu": "AMD EPYC",
    "cpu_count": 2,
    "levels": [[1, 16], [16, 64]],
    "results": {
        "1": {
            "tandem": {"output_throughput": 40.4, "p99_ttft_ms": 621.0},
            "llamacpp": {"output_throughput": 45.4, "p99_ttft_ms": 995.0, "failed": 1},
        },
        # a peer's failed level: no bar, no ratio
        "16": {
            "tandem": {"output_throughput": 60.1, "p99_ttft_ms": 9562.0},
            "llamacpp": {"error": "server: exited"},
        },
    },
}

PROMPT_CACHE_REPORT = {
    "unlimited": 0.093,
    "cpu": "AMD EPYC",
    "cpu_count": 2,
    "args": {
        "requests": 300,
        "trace": "bench/traces/mooncake_conversation_trace.jsonl",
        "first_request": 0,
        "pace": "clients",
        "time_scale": 0.25,
        "workers": 4,
    },
    "by_blocks_per_worker": {
        "512": {"pooled_lru": 0.046, "policies": {"kv": {"hit_ratio": 0.04}}},
        "1024": {
            "pooled_lru": 0.074,
            "policies": {"kv": {"hit_ratio": 0.07}, "round_robin": {"hit_ratio": 0.03}},
        },
    },
}


def _image_shape(path) -> tuple[int, ...]:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(path).shape


def test_serving_figures_keep_each_servers_values_per_level():
    figures = charts.serving_figures(SERVING_REPORT, ["tandem", "llamacpp"])
    assert figures["title"] == "tandem-demo, random 256 in / 64 out, tandem colocated x1"
    assert figures["cells"][0]["output_tok_s"] == {"tandem": 40.4, "llamacpp": 45.4}
    assert figures["cells"][0]["failed"] == {"llamacpp": 1}
    assert figures["cells"][1]["ttft_p99_ms"] == {"tandem": 9562.0}


def test_prompt_cache_figures_are_a_line_per_policy_over_sizes():
    figures = charts.prompt_cache_figures(PROMPT_CACHE_REPORT)
    assert figures["sizes"] == [512, 1024]
    assert figures["series"] == {
        charts.POOLED: [0.046, 0.074],
        "kv": [0.04, 0.07],
        "round_robin": [None, 0.03],  # not run at 512
    }


@pytest.mark.parametrize(
    "figures",
    [
        charts.serving_figures(SERVING_REPORT, ["tandem", "llamacpp"]),
        charts.prompt_cache_figures(PROMPT_CACHE_REPORT),
    ],
    ids=["serving", "prompt_cache"],
)
def test_each_chart_is_a_png_and_its_json_draws_it_again(tmp_path, figures):
    png = tmp_path / "chart.png"
    charts.write(figures, str(png))
    height, width, _ = _image_shape(png)
    assert width > 600 and height > 400
    saved = tmp_path / "chart.json"
    assert json.loads(saved.read_text()) == figures

    again = subprocess.run(
        [sys.executable, "bench/charts.py", str(saved), str(tmp_path / "again.png")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert _image_shape(tmp_path / "again.png") == (height, width, 4)
