"""A run's numbers: throughput and latency percentiles, as a table and as JSON."""

from __future__ import annotations

import statistics

from serve.bench.client import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (linear interpolation, numpy's default)."""
    ms = [v * 1000 for v in values_s]
    keys = ("mean", *(f"p{p}" for p in PERCENTILES))
    if len(ms) < 2:
        return dict.fromkeys(keys, ms[0] if ms else None)
    cuts = statistics.quantiles(ms, n=100, method="inclusive")
    return {"mean": statistics.fmean(ms), **{f"p{p}": cuts[p - 1] for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.is_success]
    # Latencies count text: a random-weight model's output may decode to none at all.
    timed = [r for r in ok if r.ttft_s is not None]
    num_output = sum(r.num_output_tokens or 0 for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_images_sent = sum(r.num_images for r in results)
    return {
        "num_successful": len(ok),
        "num_failed": sum(r.error is not None for r in results),
        "num_mismatched": sum(r.error is None and not r.is_success for r in results),
        "duration_s": duration_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": num_output / duration_s,
        "total_tokens_per_s": (num_prompt + num_output) / duration_s,
        # Every request's images, failed ones too; the throughput counts successful ones.
        "num_images_sent": num_images_sent,
        "images_per_request": num_images_sent / len(results) if results else 0.0,
        "images_per_s": sum(r.num_images for r in ok) / duration_s,
        "ttft_ms": latency_stats([r.ttft_s for r in timed]),
        "tpot_ms": latency_stats(
            [
                (r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1)
                for r in timed
                if r.e2e_s is not None and (r.num_output_tokens or 0) > 1
            ]
        ),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def format_summary(s: dict) -> str:
    rows = [
        ("Successful requests", s["num_successful"], "d"),
        ("Failed requests", s["num_failed"], "d"),
        ("Mismatched output lengths", s["num_mismatched"], "d"),
        ("Duration (s)", s["duration_s"], ".2f"),
        ("Prompt tokens", s["num_prompt_tokens"], "d"),
        ("Output tokens", s["num_output_tokens"], "d"),
        ("Request throughput (req/s)", s["requests_per_s"], ".2f"),
        ("Output token throughput (tok/s)", s["output_tokens_per_s"], ".1f"),
        ("Total token throughput (tok/s)", s["total_tokens_per_s"], ".1f"),
    ]
    if s["num_images_sent"]:  # text-only runs keep the table they had
        rows += [
            ("Images sent", s["num_images_sent"], "d"),
            ("Images per request", s["images_per_request"], ".2f"),
            ("Image throughput (img/s)", s["images_per_s"], ".2f"),
        ]
    lines = [f"{label:<34}{value:>12{fmt}}" for label, value, fmt in rows]
    header = "".join(f"{k:>10}" for k in s["ttft_ms"])
    lines.append(f"{'latency (ms)':<14}{header}")
    for name in LATENCIES:
        stats = s[f"{name}_ms"]
        cells = "".join("         -" if v is None else f"{v:>10.1f}" for v in stats.values())
        lines.append(f"{name.upper():<14}{cells}")
    return "\n".join(lines)
