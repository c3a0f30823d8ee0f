"""`serve bench`: load any OpenAI-compatible server and report what its clients see.

    serve bench --base-url http://127.0.0.1:8000 --request-rate 0.5,1,2,inf
    serve bench --dataset sharegpt --dataset-path ShareGPT.json --request-rate 4
    serve bench --dataset random-image --images-per-request 2 --image-size 224x224-672x672
    serve bench --compare before/results.json after/results.json

Each rate in `--request-rate` is one run over the same requests (a sweep); the results
go to `--output-dir` as results.json, sweep.png (throughput and TTFT / ITL / E2E
percentiles against the rate) and latency_cdf.png. `--compare` draws result files it is
given on the same plots, without sending anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

import httpx

from serve.bench import datasets
from serve.bench.client import get_model, replay, send
from serve.bench.datasets import ImageSizes, Request
from serve.bench.report import format_summary, summarize


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):  # nan is not > 0 either
        raise argparse.ArgumentTypeError("rates are positive numbers (or inf)")
    return rates


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _image_sizes(text: str) -> ImageSizes:
    try:
        return ImageSizes.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve bench",
        description="Load an OpenAI-compatible server with streamed completions and report "
        "throughput and TTFT / ITL / E2E latency, as JSON and plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="without /v1")
    target.add_argument("--model", default=None, help="default: the server's first model")
    target.add_argument(
        "--api-key",
        default=os.environ.get("SERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $SERVE_API_KEY or $OPENAI_API_KEY)",
    )
    data = p.add_argument_group("requests")
    data.add_argument(
        "--dataset", choices=("random", "sharegpt", "prefix", "random-image"), default="random"
    )
    data.add_argument("--dataset-path", type=Path, default=None, help="the ShareGPT JSON file")
    data.add_argument("--num-requests", type=_positive_int, default=64)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument(
        "--min-prompt",
        type=int,
        default=32,
        help="random: prompt tokens, least; random-image: words of text (about a token each)",
    )
    data.add_argument("--max-prompt", type=int, default=512, help="random: prompt tokens, most")
    data.add_argument("--min-output", type=int, default=16, help="random: output tokens, least")
    data.add_argument(
        "--max-output", type=int, default=256, help="random: output tokens, most; prefix: all"
    )
    data.add_argument(
        "--images-per-request", type=_positive_int, default=1, help="random-image: images each"
    )
    data.add_argument(
        "--image-size",
        type=_image_sizes,
        default=ImageSizes((336, 336), (336, 336)),
        help="random-image: WxH, or a range WxH-WxH that widths and heights are drawn "
        "from uniformly (seeded), e.g. 224x224-672x672",
    )
    data.add_argument(
        "--num-prefixes", type=_positive_int, default=4, help="prefix: distinct prefixes"
    )
    data.add_argument("--prefix-len", type=int, default=256, help="prefix: shared tokens")
    data.add_argument("--suffix-len", type=int, default=32, help="prefix: tokens of its own")
    data.add_argument(
        "--vocab-size",
        type=int,
        default=49152,
        help="random and prefix prompts draw ids from [--min-token-id, --vocab-size) "
        "(defaults: SmolLM2's vocabulary without its 17 special tokens)",
    )
    data.add_argument("--min-token-id", type=int, default=17)
    data.add_argument(
        "--tokenizer",
        default=None,
        help="sharegpt: a local tokenizer (path) to count tokens with; default: the "
        "server's POST /tokenize",
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=_rates,
        default=[float("inf")],
        help="requests per second (Poisson arrivals), or inf for all at once; a "
        "comma-separated list runs a sweep, e.g. 0.5,1,2,inf",
    )
    load.add_argument("--max-concurrency", type=_positive_int, default=None, help="most in flight")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly the output lengths of the request set (vLLM's extension)",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where results.json and the plots go (default: bench-results/DATE)",
    )
    out.add_argument("--label", default=None, help="this run's name in plots (default: model)")
    out.add_argument("--no-plots", action="store_true", help="write results.json only")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument(
        "--compare",
        nargs="+",
        type=Path,
        metavar="RESULTS_JSON",
        default=None,
        help="draw these result files on the same plots (in --output-dir) and exit",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ranges = (("min_prompt", "max_prompt"), ("min_output", "max_output"))
    for least, most in ranges if args.dataset in ("random", "random-image") else ():
        low, high = getattr(args, least), getattr(args, most)
        flags = f"--{least.replace('_', '-')}", f"--{most.replace('_', '-')}"
        if low < 1 or low > high:
            parser.error(f"{flags[0]} ({low}) must be at least 1 and at most {flags[1]} ({high})")
    if args.vocab_size <= args.min_token_id:
        parser.error(
            f"--vocab-size ({args.vocab_size}) must be above --min-token-id ({args.min_token_id})"
        )
    output_dir = args.output_dir or Path("bench-results") / datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.compare:
        results = []
        for path in args.compare:
            try:
                result = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                print(f"serve bench: cannot read {path}: {e}", file=sys.stderr)
                return 2
            if not isinstance(result, dict) or not isinstance(result.get("runs"), list):
                print(f"serve bench: {path} is not a serve bench results.json", file=sys.stderr)
                return 2
            results.append(result)
        output_dir.mkdir(parents=True, exist_ok=True)
        return 0 if write_plots(results, output_dir) else 1
    try:
        result = asyncio.run(run(args))
    except (ValueError, httpx.HTTPError) as e:
        print(f"serve bench: {e}", file=sys.stderr)
        return 1
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "results.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    if not args.no_plots:
        write_plots([result], output_dir)
    failed = sum(r["summary"]["num_failed"] for r in result["runs"])
    return 1 if failed else 0


def write_plots(results: list[dict], output_dir: Path) -> bool:
    try:
        from serve.bench.plots import plot_latency_cdf, plot_sweep
    except ImportError:
        print("serve bench: plots need matplotlib: pip install 'serve[bench]'", file=sys.stderr)
        return False
    for name, plot in (("sweep.png", plot_sweep), ("latency_cdf.png", plot_latency_cdf)):
        plot(results).savefig(output_dir / name, dpi=100)
        print(f"wrote {output_dir / name}")
    return True


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or max(args.num_requests, 1))
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        model, max_model_len = await get_model(client, args.model)
        requests = make_requests(args, max_model_len, _token_counter(args, model))
        print(f"url={args.base_url} model={model} dataset={args.dataset} requests={len(requests)}")
        warmup = await send(
            client, model, replace(requests[0], num_output_tokens=2), 0.0, args.ignore_eos
        )
        if warmup.error is not None:
            raise ValueError(f"the warm-up request failed: {warmup.error}")
        runs = []
        for rate in args.request_rate:
            progress = _progress(len(requests), f"rate {rate:g}", args.no_progress)
            results, duration_s = await replay(
                client,
                model,
                requests,
                rate,
                args.max_concurrency,
                args.seed,
                args.temperature,
                args.ignore_eos,
                on_done=lambda _, bar=progress: bar.update(1),
            )
            progress.close()
            summary = summarize(results, duration_s)
            print(f"\n== request rate {rate:g} req/s ==\n{format_summary(summary)}")
            for error in sorted({r.error for r in results if r.error is not None})[:3]:
                print(f"error: {error}")
            runs.append(
                {
                    "request_rate": f"{rate:g}",  # "inf": JSON has no infinity
                    "summary": summary,
                    "requests": [asdict(r) for r in results],
                }
            )
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "compare")}
    config["request_rate"] = [f"{r:g}" for r in args.request_rate]
    config["dataset_path"] = None if args.dataset_path is None else str(args.dataset_path)
    config["output_dir"] = None if args.output_dir is None else str(args.output_dir)
    config["image_size"] = str(args.image_size)  # "336x336" or "224x224-672x672"
    return {
        "label": args.label or model,
        "model": model,
        "date": datetime.now().isoformat(timespec="seconds"),
        "config": config,
        "runs": runs,
    }


def make_requests(
    args: argparse.Namespace, max_model_len: int | None, count_tokens: Callable[[str], int]
) -> list[Request]:
    token_ids = range(args.min_token_id, args.vocab_size)
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        return datasets.sharegpt_requests(
            args.dataset_path, args.num_requests, count_tokens, max_model_len, args.seed
        )
    if args.dataset == "prefix":
        longest = args.prefix_len + args.suffix_len + args.max_output
        requests = datasets.prefix_requests(
            args.num_requests,
            args.num_prefixes,
            args.prefix_len,
            args.suffix_len,
            args.max_output,
            token_ids,
            args.seed,
        )
    elif args.dataset == "random-image":
        longest = args.max_prompt + args.max_output  # text only: the images' tokens come on top
        requests = datasets.random_image_requests(
            args.num_requests,
            (args.min_prompt, args.max_prompt),
            (args.min_output, args.max_output),
            args.image_size,
            args.images_per_request,
            args.seed,
        )
    else:
        longest = args.max_prompt + args.max_output
        requests = datasets.random_requests(
            args.num_requests,
            (args.min_prompt, args.max_prompt),
            (args.min_output, args.max_output),
            token_ids,
            args.seed,
        )
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(
            f"the longest request ({longest} tokens) is past the server's context of "
            f"{max_model_len}: lower --max-prompt / --max-output"
        )
    return requests


def _token_counter(args: argparse.Namespace, model: str) -> Callable[[str], int]:
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    session = httpx.Client(base_url=args.base_url, headers=headers, timeout=30)

    def count(text: str) -> int:
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        response = session.post("/tokenize", json=body)
        if response.status_code != 200:
            raise ValueError(
                f"the server's /tokenize answered {response.status_code}: give --tokenizer"
            )
        return int(response.json()["count"])

    return count


def _progress(total: int, desc: str, disabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=disabled)
