"""The load generator: streamed completions sent on a schedule, timed as a client sees them.

Per request (vLLM's benchmark definitions):
  TTFT  from sending the request to the first chunk with non-empty text;
  ITL   between consecutive non-empty text chunks (a chunk carrying several tokens counts
        as one gap: a client sees text, not tokens);
  TPOT  (E2E - TTFT) / (output tokens - 1);
  E2E   from sending the request to the end of its stream.
A request succeeds when its stream ends without an error and, where output lengths are
forced (`ignore_eos`, the default), its usage chunk reports the number of output tokens
asked for; the others count as failed (an HTTP or stream error) or mismatched. Without
`ignore_eos` a model may stop early: any length counts. Works against any OpenAI-compatible server that streams usage and
accepts vLLM's `ignore_eos` (serve, vLLM, SGLang).

Requests with images go to `/v1/chat/completions` as one user message (the text, then
`image_url` parts), their text read from `delta.content`; the others to
`/v1/completions`, read from `text`. The stream and its timing are the same.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from serve.bench.datasets import Request


@dataclass
class RequestResult:
    num_prompt_tokens: int
    num_requested_tokens: int
    num_output_tokens: int | None = None  # from the usage chunk
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None
    forces_length: bool = True  # sent with ignore_eos: its length is known in advance
    num_images: int = 0

    @property
    def is_success(self) -> bool:
        if self.error is not None:
            return False
        return not self.forces_length or self.num_output_tokens == self.num_requested_tokens


async def get_model(client: httpx.AsyncClient, model: str | None) -> tuple[str, int | None]:
    """The model to ask for (default: the server's first) and its context length, where
    the server reports one."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    cards = response.json()["data"]
    card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
    return (model or card["id"]), (card or {}).get("max_model_len")


async def send(
    client: httpx.AsyncClient,
    model: str,
    request: Request,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    """One streamed completion; never raises for the server's errors (they are recorded).
    `extra`: more body fields (e.g. `min_tokens`), sent as given."""
    result = RequestResult(
        request.num_prompt_tokens,
        request.num_output_tokens,
        forces_length=ignore_eos,
        num_images=len(request.image_urls),
    )
    path, payload = _endpoint_and_body(request)
    payload |= {
        "model": model,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=payload) as response:
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
                    if not isinstance(request.prompt, list):
                        result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                if any(_text(choice) for choice in chunk.get("choices", [])):
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.e2e_s = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _endpoint_and_body(request: Request) -> tuple[str, dict[str, Any]]:
    """Where the request goes, and the body fields that differ between the two."""
    if not request.image_urls:
        body = {"prompt": request.prompt, "max_tokens": request.num_output_tokens}
        return "/v1/completions", body
    images = [{"type": "image_url", "image_url": {"url": url}} for url in request.image_urls]
    content = [{"type": "text", "text": request.prompt}, *images]
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_completion_tokens": request.num_output_tokens,
    }
    return "/v1/chat/completions", body


def _text(choice: dict[str, Any]) -> str | None:
    """A streamed choice's new text: a completion's `text`, a chat's `delta.content`."""
    return choice.get("text") or (choice.get("delta") or {}).get("content")


async def replay(
    client: httpx.AsyncClient,
    model: str,
    requests: list[Request],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    on_done: Callable[[RequestResult], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time: all at once (`inf`), or as a seeded
    Poisson process of `request_rate` per second; at most `max_concurrency` in flight.
    `extra`: more body fields for every request (`send`'s). Returns the results in request
    order and the duration in seconds."""
    arrivals = random.Random(seed + 1)  # independent of the request set's RNG stream
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)

    async def limited(request: Request) -> RequestResult:
        async with limit:
            result = await send(client, model, request, temperature, ignore_eos, extra)
        if on_done is not None:
            on_done(result)
        return result

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(limited(request)))
        if request_rate != float("inf"):
            await asyncio.sleep(arrivals.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start
