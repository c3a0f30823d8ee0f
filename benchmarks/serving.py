"""Online serving: replay the seeded synthetic workload against an OpenAI-compatible server.

Sends the same requests as `throughput.py` (random prompt token ids, fixed output lengths)
to POST /v1/completions with `stream: true` and `ignore_eos: true` (a vLLM extension that
serve accepts too), all at once (`--request-rate inf`) or as a seeded Poisson process.

    serve --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate 4

Metrics, per request (vLLM's benchmark_serving definitions):
  TTFT  time from sending the request to the first chunk with non-empty text.
  ITL   time between consecutive non-empty text chunks; a chunk carrying several tokens
        counts as one gap (the client sees text, not tokens).
  TPOT  (E2E - TTFT) / (output tokens - 1): the mean time per token after the first.
  E2E   time from sending the request to the end of its stream.
A request succeeds when its stream ends without an error and its usage chunk reports
exactly the requested number of output tokens; the rest count as failed (an HTTP or stream
error) or mismatched (a wrong or missing token count). Latencies cover successes only.
Sampling is greedy (`--temperature 0`), as in throughput.py and vLLM's benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import workload
from workload import Request, WorkloadSpec


@dataclass
class RequestResult:
    num_prompt_tokens: int
    num_requested_tokens: int
    num_output_tokens: int | None = None  # from the usage chunk
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.error is None and self.num_output_tokens == self.num_requested_tokens


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    p.add_argument("--api-key", default=None)
    workload.add_workload_args(p)
    p.add_argument("--vocab-size", type=int, default=49152, help="default: SmolLM2's")
    p.add_argument(
        "--min-token-id",
        type=int,
        default=17,
        help="prompts draw ids from [min-token-id, vocab-size); SmolLM2's 17 special tokens "
        "are ids 0-16, so the defaults replay throughput.py's requests exactly",
    )
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s; inf: all at once"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args()


async def get_model(client: httpx.AsyncClient, model: str | None) -> tuple[str, int | None]:
    """The model to request and its context length, where the server reports one."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    cards = response.json()["data"]
    card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
    return (model or card["id"]), (card or {}).get("max_model_len")


async def send(
    client: httpx.AsyncClient, model: str, request: Request, temperature: float
) -> RequestResult:
    result = RequestResult(len(request.prompt_token_ids), request.num_output_tokens)
    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.num_output_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.e2e_s = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def replay(
    client: httpx.AsyncClient, model: str, requests: list[Request], args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    """Send every request on its arrival time; returns (results, duration in seconds)."""
    arrivals = random.Random(args.seed + 1)  # independent of the workload's RNG stream
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))

    async def limited(request: Request) -> RequestResult:
        async with limit:
            return await send(client, model, request, args.temperature)

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(limited(request)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(arrivals.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (linear interpolation, as numpy's default)."""
    ms = [v * 1000 for v in values_s]
    if len(ms) < 2:
        return dict.fromkeys(("mean", "p50", "p90", "p99"), ms[0] if ms else None)
    cuts = statistics.quantiles(ms, n=100, method="inclusive")
    return {"mean": statistics.fmean(ms), "p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.is_success]
    # Latencies count text: a random-weight model's output may decode to none at all.
    timed = [r for r in ok if r.ttft_s is not None]
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
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
        "ttft_ms": latency_stats([r.ttft_s for r in timed]),
        "tpot_ms": latency_stats(
            [
                (r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1)
                for r in timed
                if r.num_output_tokens > 1
            ]
        ),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok]),
    }


def print_summary(s: dict) -> None:
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
    for label, value, fmt in rows:
        print(f"{label:<34}{value:>12{fmt}}")
    print(f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = s[f"{name}_ms"]
        cells = "".join("         -" if v is None else f"{v:>10.1f}" for v in stats.values())
        print(f"{name.upper():<14}{cells}")


async def main() -> None:
    args = parse_args()
    spec = WorkloadSpec.from_args(args)
    requests = workload.make_requests(spec, range(args.min_token_id, args.vocab_size))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_requests)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        model, max_model_len = await get_model(client, args.model)
        longest = args.max_prompt + args.max_output
        if max_model_len is not None and longest > max_model_len:
            sys.exit(f"--max-prompt + --max-output = {longest} > the server's {max_model_len}")
        print(
            f"url={args.base_url} model={model} requests={len(requests)} rate={args.request_rate}"
        )
        warmup = await send(client, model, Request(requests[0].prompt_token_ids[:8], 2), 0.0)
        if warmup.error is not None:
            sys.exit(f"warm-up request failed: {warmup.error}")
        results, duration_s = await replay(client, model, requests, args)

    summary = summarize(results, duration_s)
    print_summary(summary)
    errors = sorted({r.error for r in results if r.error is not None})
    for error in errors[:5]:
        print(f"error: {error}")
    if args.json:
        date = datetime.now().isoformat(timespec="seconds")
        config = vars(args) | {"model": model, "request_rate": str(args.request_rate), "date": date}
        config["api_key"] = "<set>" if args.api_key else None  # never write the key itself
        payload = {"config": config, "summary": summary, "requests": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    asyncio.run(main())
