"""The benchmarks' figures as PNG charts (matplotlib's Agg backend: no display), each written
with the figures it draws as JSON beside it (the same stem), so a chart is drawn again without
rerunning its benchmark:

    .venv/bin/python bench/charts.py docs/img/benchmarks/serving-llamacpp.json [OUT.png]

Two kinds, told apart by the JSON's "kind":
- "serving" (bench/serving.py --chart): per concurrency level a bar for each server's output
  tok/s, and in a second panel its TTFT p99; a peer's bar carries tandem / that peer (above 1x:
  tandem faster for tok/s, slower for TTFT).
- "prompt_cache" (bench/prompt_cache.py --chart): the hit ratio against KV blocks per worker, a
  line for each routing policy and one for the offline pooled LRU cache, and the unlimited
  cache's ratio as a horizontal line.
"""

from __future__ import annotations

import json
import os
import sys

REFERENCE = "tandem"  # the server every other server's bar is compared with
POOLED = "pooled LRU (offline)"
# (figures key, bench/serving.py's result key, panel title)
SERVING_PANELS = (
    ("output_tok_s", "output_throughput", "output tok/s (higher is better)"),
    ("ttft_p99_ms", "p99_ttft_ms", "TTFT p99 ms (lower is better)"),
)


def serving_figures(report: dict, impls: list[str]) -> dict:
    """bench/serving.py's report (build/bench-serving-DATASET.json) as a serving chart's figures;
    a server whose level failed has no value there."""
    dataset = report["dataset"]
    if dataset == "random":
        dataset += f" {report['input_len']} in / {report['output_len']} out"
    cells = []
    for concurrency, num_prompts in report["levels"]:
        results = report["results"].get(str(concurrency), {})
        cell = {"concurrency": concurrency, "num_prompts": num_prompts}
        for key, result_key, _ in SERVING_PANELS:
            cell[key] = {
                i: results[i][result_key] for i in impls if result_key in results.get(i, {})
            }
        # a server's figures count only the requests it completed
        cell["failed"] = {
            i: results[i]["failed"] for i in impls if results.get(i, {}).get("failed")
        }
        cells.append(cell)
    return {
        "kind": "serving",
        "title": f"{report['served_model_name']}, {dataset}, tandem {report['topology']}",
        "machine": f"{report['cpu']}, {report['cpu_count']} cores",
        "impls": impls,
        "cells": cells,
    }


def prompt_cache_figures(report: dict) -> dict:
    """bench/prompt_cache.py's report (build/bench-prompt-cache.json) as a prompt_cache chart's
    figures: a policy not run at a size has null there."""
    by_size = report["by_blocks_per_worker"]
    sizes = sorted(by_size, key=int)
    policies = list(dict.fromkeys(p for s in sizes for p in by_size[s]["policies"]))
    series = {POOLED: [by_size[s]["pooled_lru"] for s in sizes]}
    for policy in policies:
        series[policy] = [by_size[s]["policies"].get(policy, {}).get("hit_ratio") for s in sizes]
    args = report["args"]
    return {
        "kind": "prompt_cache",
        "title": f"{args['requests']} requests of {os.path.basename(args['trace'])} from row "
        f"{args['first_request']}, pace {args['pace']}, arrival times x{args['time_scale']}",
        "machine": f"{report['cpu']}, {report.get('cpu_count', '?')} cores",
        "x_label": f"KV blocks per worker ({args['workers']} workers, 16 tokens a block)",
        "sizes": [int(s) for s in sizes],
        "series": series,
        "unlimited": report["unlimited"],
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    return plt


def render_serving(figures: dict, path: str) -> None:
    plt = _pyplot()
    impls, cells = figures["impls"], figures["cells"]
    reference = REFERENCE if REFERENCE in impls else impls[0]
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(1, len(SERVING_PANELS), figsize=(5.5 * len(SERVING_PANELS), 4.6))
    for ax, (key, _, title) in zip(axes, SERVING_PANELS):
        values = [v for cell in cells for v in cell[key].values()]
        for k, impl in enumerate(impls):
            xs, ys, labels = [], [], []
            for x, cell in enumerate(cells):
                at = x + (k - (len(impls) - 1) / 2) * width
                value, base = cell[key].get(impl), cell[key].get(reference)
                if value is None:  # its level failed: said where its bar would stand
                    ax.text(
                        at,
                        0.02,
                        "no result",
                        transform=ax.get_xaxis_transform(),
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
                    continue
                xs.append(at)
                ys.append(value)
                ratio = f"\n{base / value:.2f}x" if impl != reference and base and value else ""
                labels.append(f"{value:,.0f}{ratio}")
            bars = ax.bar(xs, ys, width, label=impl)
            ax.bar_label(bars, labels, fontsize=7, padding=2)
        # TTFT spans orders of magnitude from c1 to c64: a linear axis hides the small cells
        if values and min(values) > 0 and max(values) / min(values) > 30:
            ax.set_yscale("log")
            ax.set_ylim(top=max(values) * 6)
        else:
            ax.set_ylim(top=max(values, default=1) * 1.25)
        ax.set_xticks(range(len(cells)), [_level_label(c) for c in cells], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"{figures['title']}\n{figures['machine']}; under a peer's value: {reference} / peer",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _level_label(cell: dict) -> str:
    failed = ", ".join(f"{impl} {n}" for impl, n in cell.get("failed", {}).items())
    return f"c{cell['concurrency']}\n{cell['num_prompts']} prompts" + (
        f"\nfailed: {failed}" if failed else ""
    )


def render_prompt_cache(figures: dict, path: str) -> None:
    plt = _pyplot()
    sizes = figures["sizes"]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for name, ratios in figures["series"].items():
        ys = [float("nan") if r is None else r for r in ratios]  # a size the policy missed
        # the reference drawn over the policies it bounds
        style = {"linestyle": "--", "color": "black", "zorder": 3} if name == POOLED else {}
        ax.plot(sizes, ys, marker="o", label=name, **style)
    unlimited = figures["unlimited"]
    ax.axhline(unlimited, color="grey", linestyle=":", label=f"unlimited cache ({unlimited:.3f})")
    if len(sizes) > 1:  # sizes double from point to point
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
    ax.minorticks_off()
    ax.set_ylim(0, unlimited * 1.25 or 1)
    ax.set_xlabel(figures["x_label"])
    ax.set_ylabel("hit ratio (cached / prompt tokens)")
    ax.set_title(f"{figures['title']}\n{figures['machine']}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RENDERERS = {"serving": render_serving, "prompt_cache": render_prompt_cache}


def figures_path(png_path: str) -> str:
    return os.path.splitext(png_path)[0] + ".json"


def write(figures: dict, png_path: str) -> None:
    """The chart at `png_path` and its figures beside it (figures_path)."""
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    with open(figures_path(png_path), "w") as f:
        json.dump(figures, f, indent=1)
        f.write("\n")
    RENDERERS[figures["kind"]](figures, png_path)


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} FIGURES.json [OUT.png]  (default: FIGURES.png)")
    with open(sys.argv[1]) as f:
        figures = json.load(f)
    out = sys.argv[2] if len(sys.argv) == 3 else os.path.splitext(sys.argv[1])[0] + ".png"
    RENDERERS[figures["kind"]](figures, out)
    print(out)


if __name__ == "__main__":
    main()
