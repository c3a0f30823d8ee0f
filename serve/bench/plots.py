"""Pictures of `serve bench` results (matplotlib, from the `serve[bench]` extra).

Both plots take one or more result files' contents (`--compare` draws several on the
same axes) and return the Figure; the caller saves it. No pyplot: no global state, no
display needed.
"""

from __future__ import annotations

from matplotlib.figure import Figure

PERCENTILE_STYLES = {"p50": "-", "p90": "--", "p99": ":"}


def offered_rate(run: dict) -> float:
    """Where a run sits on the rate axis: its offered request rate, or, for all at once
    (inf), the rate it achieved."""
    rate = float(run["request_rate"])
    return run["summary"]["requests_per_s"] if rate == float("inf") else rate


def plot_sweep(results: list[dict]) -> Figure:
    """Throughput and TTFT / ITL / E2E percentiles against the request rate."""
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    colors = [f"C{i}" for i in range(len(results))]
    for result, color in zip(results, colors):
        runs = sorted(result["runs"], key=offered_rate)
        rates = [offered_rate(r) for r in runs]
        label = result["label"]
        throughput = [r["summary"]["output_tokens_per_s"] for r in runs]
        axes[0][0].plot(rates, throughput, "o-", color=color, label=label)
        for run, x, y in zip(runs, rates, throughput):
            if float(run["request_rate"]) == float("inf"):
                axes[0][0].annotate(
                    "all at once",
                    (x, y),
                    textcoords="offset points",
                    xytext=(-60, 0),
                    fontsize="small",
                    color=color,
                )
        for ax, name in ((axes[0][1], "ttft"), (axes[1][0], "itl"), (axes[1][1], "e2e")):
            for pct, style in PERCENTILE_STYLES.items():
                values = [r["summary"][f"{name}_ms"][pct] for r in runs]
                points = [(x, y) for x, y in zip(rates, values) if y is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{label} {pct}")
    titles = (
        ("Output throughput", "tokens/s"),
        ("Time to first token", "ms"),
        ("Inter-token latency", "ms"),
        ("End-to-end latency", "ms"),
    )
    for ax, (title, unit) in zip(axes.flat, titles):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s; all at once: the rate it reached)")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def plot_latency_cdf(results: list[dict]) -> Figure:
    """The distribution of TTFT and E2E over a run's successful requests, per rate."""
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    for i, result in enumerate(results):
        runs = sorted(result["runs"], key=offered_rate)
        for j, run in enumerate(runs):
            label = f"{result['label']} @ {run['request_rate']} req/s"
            ok = [r for r in run["requests"] if r["error"] is None and r["e2e_s"] is not None]
            for ax, key in ((axes[0], "ttft_s"), (axes[1], "e2e_s")):
                values = sorted(r[key] * 1000 for r in ok if r[key] is not None)
                if not values:
                    continue
                fractions = [(k + 1) / len(values) for k in range(len(values))]
                style = ("-", "--", ":", "-.")[i % 4]
                ax.step(values, fractions, style, where="post", color=f"C{j}", label=label)
    for ax, title in zip(axes, ("Time to first token", "End-to-end latency")):
        ax.set_title(f"{title}: CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig
