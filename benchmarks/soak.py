"""Soak: a steady mixed load with random disconnects for minutes, watching for leaks.

    python benchmarks/soak.py --minutes 10

Starts a server (the default model unless `--model`), then keeps `--concurrency` clients
busy with a mix of chat and completions, streamed and not, greedy and sampled, n=2 and
JSON-schema requests; `--disconnect-rate` of the streams hang up at a random point.
Every greedy answer is checked against the answer the same request got before the load
began (a corrupted response differs), every other answer for its shape, and every request
that neither hung up nor completed counts as lost. Reports the server's RSS (API process
and engine core) over time, its growth after the warm-up, the errors, and the KV blocks
held once the load stops (all must be free). Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from server_process import start_server, stop_server

RSS_GROWTH_LIMIT = 0.05
GREEDY_PROMPTS = [
    "Write one sentence about the sea.",
    "List three colours.",
    "What is 12 times 12?",
    "Name a famous painter.",
    "Describe a cat in five words.",
    "Say hello in French.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--flags", default="--max-model-len 2048", help="extra serve flags")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="of the run, before RSS")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--disconnect-rate", type=float, default=0.25)
    p.add_argument("--rss-interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    return p.parse_args()


@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)  # lost or corrupted, with why
    kinds: dict[str, int] = field(default_factory=dict)


def greedy_body(i: int, chat: bool) -> dict:
    prompt = GREEDY_PROMPTS[i % len(GREEDY_PROMPTS)]
    body = {"temperature": 0, "max_tokens": 48}
    if chat:
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


def random_request(rng: random.Random, model: str) -> tuple[str, str, dict]:
    """(kind, path, body) of one request of the mix."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    roll = rng.random()
    if roll < 0.4:
        kind, body = f"greedy-{rng.randrange(len(GREEDY_PROMPTS))}", None
        body = greedy_body(int(kind.split("-")[1]), chat)
    elif roll < 0.7:
        kind = "sampled"
        body = {"temperature": 0.9, "top_p": 0.95, "max_tokens": rng.randint(8, 160)}
        body["ignore_eos"] = True
    elif roll < 0.85:
        kind = "n2"
        body = {"n": 2, "temperature": 0.8, "seed": rng.randrange(1000), "max_tokens": 32}
    else:
        kind = "json"
        body = {
            "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        }
    if "messages" not in body and "prompt" not in body:
        text = f"Request {rng.randrange(10**6)}: tell me something."
        body["messages" if chat else "prompt"] = (
            [{"role": "user", "content": text}] if chat else text
        )
    return kind, path, {"model": model, **body}


def choice_text(choice: dict, chat: bool) -> str:
    return (choice.get("message") or {}).get("content") or "" if chat else choice["text"]


async def run_one(
    client: httpx.AsyncClient,
    rng: random.Random,
    model: str,
    expected: dict[tuple[str, bool], str],
    args: argparse.Namespace,
    tally: Tally,
) -> None:
    kind, path, body = random_request(rng, model)
    chat = "chat" in path
    tally.kinds[kind] = tally.kinds.get(kind, 0) + 1
    stream = kind != "n2" and rng.random() < 0.6
    cut_after = rng.randint(1, 20) if stream and rng.random() < args.disconnect_rate else None
    try:
        if stream:
            texts, finish_reasons, usage = await stream_request(client, path, body, cut_after)
            if texts is None:
                tally.disconnected += 1
                return
        else:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                tally.errors.append(f"{kind}: HTTP {response.status_code} {response.text[:200]}")
                return
            data = response.json()
            texts = [choice_text(c, chat) for c in data["choices"]]
            finish_reasons = [c["finish_reason"] for c in data["choices"]]
            usage = data["usage"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        tally.errors.append(f"{kind}: {type(e).__name__}: {e}")
        return
    problem = check_answer(kind, body, texts, finish_reasons, usage, expected.get((kind, chat)))
    if problem:
        tally.errors.append(f"{kind}: {problem}")
        return
    tally.completed += 1
    tally.tokens += usage["completion_tokens"]


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict, cut_after: int | None
) -> tuple[list[str] | None, list[str | None], dict]:
    """The streamed text and finish reason of each choice, and the usage; (None, [], {})
    if the client hung up."""
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    texts: dict[int, str] = {}
    finish_reasons: dict[int, str | None] = {}
    usage: dict = {}
    events = 0
    async with client.stream("POST", path, json=request) as response:
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise ValueError(f"error event: {chunk['error']}")
            events += 1
            if events == cut_after:
                return None, [], {}  # leaving the block closes the connection mid-stream
            for choice in chunk["choices"]:
                delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + delta
                finish_reasons[choice["index"]] = choice["finish_reason"]
            usage = chunk.get("usage") or usage
    order = sorted(texts)
    return [texts[i] for i in order], [finish_reasons[i] for i in order], usage


def check_answer(
    kind: str,
    body: dict,
    texts: list[str],
    finish_reasons: list[str | None],
    usage: dict,
    expected: str | None,
) -> str | None:
    """Why the answer is wrong, or None."""
    if not usage or usage.get("completion_tokens", 0) <= 0:
        return f"no usage: {usage}"
    if kind.startswith("greedy") and texts != [expected]:
        return f"greedy answer changed: {texts!r} != {[expected]!r}"
    if kind == "n2" and len(texts) != 2:
        return f"{len(texts)} choices for n=2"
    if kind == "sampled" and usage["completion_tokens"] != body["max_tokens"]:
        return f"{usage['completion_tokens']} tokens, asked {body['max_tokens']} (ignore_eos)"
    if any(reason not in ("stop", "length") for reason in finish_reasons):
        return f"finish reasons {finish_reasons}"
    if kind == "json" and finish_reasons == ["stop"]:  # "length": cut short, not whole
        try:
            value = json.loads(texts[0])
        except ValueError:
            return f"not JSON: {texts[0]!r}"
        if not isinstance(value, dict) or set(value) != {"name", "age"}:
            return f"does not follow the schema: {texts[0]!r}"
    return None


def rss_mib(server: psutil.Process) -> tuple[float, float]:
    """RSS of the API process and of its children (the engine core), MiB."""
    children = server.children(recursive=True)
    core = sum(p.memory_info().rss for p in children if p.is_running())
    return server.memory_info().rss / 2**20, core / 2**20


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def soak(url: str, model: str, server: psutil.Process, args) -> dict:
    # Generous: a request that takes longer is counted as lost, and on a loaded CPU a long
    # sampled request can take minutes.
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        expected = {}
        for i, _prompt in enumerate(GREEDY_PROMPTS):
            for chat in (False, True):
                path = "/v1/chat/completions" if chat else "/v1/completions"
                data = (
                    await client.post(path, json={"model": model, **greedy_body(i, chat)})
                ).json()
                expected[(f"greedy-{i}", chat)] = choice_text(data["choices"][0], chat)

        tally = Tally()
        samples: list[tuple[float, float, float]] = []  # (seconds, api MiB, core MiB)
        start = time.monotonic()
        end = start + 60 * args.minutes

        async def client_loop(worker: int) -> None:
            rng = random.Random(args.seed * 1000 + worker)
            while time.monotonic() < end:
                await run_one(client, rng, model, expected, args, tally)

        async def sample_rss() -> None:
            while time.monotonic() < end:
                samples.append((time.monotonic() - start, *rss_mib(server)))
                print(
                    f"{samples[-1][0]:6.0f} s  RSS api {samples[-1][1]:7.1f} MiB, core "
                    f"{samples[-1][2]:7.1f} MiB; {tally.completed} completed, "
                    f"{tally.disconnected} disconnected, {len(tally.errors)} errors",
                    flush=True,
                )
                await asyncio.sleep(args.rss_interval)

        await asyncio.gather(sample_rss(), *(client_loop(w) for w in range(args.concurrency)))
        elapsed = time.monotonic() - start
        samples.append((elapsed, *rss_mib(server)))

    idle = scrape(url)
    deadline = time.monotonic() + 60
    while idle.get("serve_num_requests_running", 1) + idle.get("serve_num_requests_waiting", 1):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
        idle = scrape(url)
    after_warmup = [s for s in samples if s[0] >= args.warmup_fraction * elapsed]
    first, last = after_warmup[0], samples[-1]
    return {
        "minutes": elapsed / 60,
        "concurrency": args.concurrency,
        "completed": tally.completed,
        "disconnected": tally.disconnected,
        "errors": tally.errors,
        "kinds": tally.kinds,
        "output_tokens": tally.tokens,
        "rss_mib": {
            "warm": {"api": first[1], "core": first[2], "at_s": first[0]},
            "end": {"api": last[1], "core": last[2], "at_s": last[0]},
            # Per process: the core's RSS is mostly the KV cache, which would hide a leak in
            # the API process in a total.
            "growth_after_warmup": {
                "api": (last[1] - first[1]) / first[1],
                "core": (last[2] - first[2]) / first[2],
            },
        },
        "rss_samples": samples,
        "kv_blocks_used_at_end": idle.get("serve_kv_cache_blocks_used"),
        "requests_running_at_end": idle.get("serve_num_requests_running"),
    }


def main() -> None:
    args = parse_args()
    process, url, log_path = start_server(args.model, args.flags.split(), args.log_dir, "soak")
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        result = asyncio.run(soak(url, model, psutil.Process(process.pid), args))
    finally:
        exit_code = stop_server(process)
    result["exit_code_after_sigterm"] = exit_code
    rss = result["rss_mib"]
    growth = rss["growth_after_warmup"]
    print(
        f"\n{result['minutes']:.1f} min, {args.concurrency} clients: {result['completed']} "
        f"completed, {result['disconnected']} disconnected on purpose, "
        f"{len(result['errors'])} lost or corrupted; {result['output_tokens']} output tokens\n"
        f"RSS from the end of warm-up to the end: API process {rss['warm']['api']:.0f} -> "
        f"{rss['end']['api']:.0f} MiB ({growth['api']:+.1%}), engine core "
        f"{rss['warm']['core']:.0f} -> {rss['end']['core']:.0f} MiB ({growth['core']:+.1%})\n"
        f"KV blocks held at the end: {result['kv_blocks_used_at_end']:.0f}; "
        f"exit code after SIGTERM: {exit_code}; server log: {log_path}"
    )
    for error in result["errors"][:20]:
        print("  error:", error)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    failed = (
        result["errors"]
        or result["kv_blocks_used_at_end"] != 0
        or max(growth.values()) > RSS_GROWTH_LIMIT
        or exit_code != 0
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
