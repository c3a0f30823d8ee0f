"""Offline throughput: serve's continuous batching against HF transformers' static batches.

Every request has a random prompt and a fixed output length (`ignore_eos`), drawn from a
seeded RNG, so both engines do the same useful work. HF pads each static batch to its
longest prompt and decodes until its longest output: the tokens past a request's own
length are wasted, which is what continuous batching is meant to win back.

    python benchmarks/throughput.py --num-requests 64
    python benchmarks/throughput.py --skip-serve --num-requests 8 --max-output 16
    python benchmarks/throughput.py --skip-hf --decoding-mix   # plain vs mixed controls

`--decoding-mix` runs serve twice on the same requests in one process: all greedy, then a
mix where half the requests use penalties with top-p sampling and a quarter follow a JSON
schema (the rest stay greedy), and reports the mix's output tokens/s relative to plain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import workload
from workload import Request, WorkloadSpec


@dataclass(frozen=True)
class Result:
    name: str
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int  # useful tokens only: each request's own output length

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    @classmethod
    def of(cls, name: str, elapsed_s: float, requests: list[Request], num_output: int) -> Result:
        num_prompt = sum(len(r.prompt_token_ids) for r in requests)
        return cls(name, elapsed_s, len(requests), num_prompt, num_output)

    def as_dict(self) -> dict:
        rates = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
        return asdict(self) | {k: getattr(self, k) for k in rates}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir or .gguf; default: serve's default")
    workload.add_workload_args(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--hf-batch-sizes", default="8,16,32,64", help="comma-separated sweep")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument(
        "--decoding-mix",
        action="store_true",
        help="also run serve with penalties, top-p and JSON schemas mixed in",
    )
    p.add_argument(
        "--compare-serial",
        action="store_true",
        help="also run serve one step at a time (async_scheduling=False), alternating with "
        "the default twice each",
    )
    p.add_argument(
        "--compare-tp",
        type=int,
        default=None,
        metavar="N",
        help="also run serve at tensor_parallel_size N (one process per rank), after the "
        "one-rank run, and report the ratio",
    )
    p.add_argument(
        "--compare-eager",
        action="store_true",
        help="also run serve with its decode steps eager (cuda_graphs=False), after the "
        "default run, which replays them as CUDA graphs on a GPU, and report the ratio",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args()


def resolve_model_dir(model: str | None) -> Path:
    """The safetensors directory HF loads: the same weights serve runs."""
    from serve.models.default_model import resolve_default_model, resolve_gguf

    if model is None:
        return resolve_default_model()
    return resolve_gguf(model) if model.endswith(".gguf") else Path(model)


def make_requests(args: argparse.Namespace, tokenizer) -> list[Request]:
    return workload.make_requests(
        WorkloadSpec.from_args(args), workload.ordinary_token_ids(tokenizer)
    )


# The schema of the mix's structured requests: a long list, so that (like every other
# request) they run to their own output length rather than end early.
ITEMS_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 12},
                    "kind": {"type": "string", "enum": ["a", "b", "c"]},
                },
                "required": ["id", "name", "kind"],
            },
        }
    },
    "required": ["items"],
}


def plain_params(requests: list[Request]) -> list:
    from serve import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=r.num_output_tokens, ignore_eos=True)
        for r in requests
    ]


def mixed_params(requests: list[Request]) -> list:
    """Per four requests: two with penalties and top-p sampling, one JSON schema, one
    greedy."""
    from serve import SamplingParams
    from serve.sampling_params import StructuredOutputsParams

    params = []
    for i, r in enumerate(requests):
        common = {"max_tokens": r.num_output_tokens, "ignore_eos": True}
        if i % 4 in (0, 1):
            params.append(
                SamplingParams(
                    temperature=0.8,
                    top_p=0.9,
                    seed=i,
                    presence_penalty=0.5,
                    frequency_penalty=0.5,
                    repetition_penalty=1.1,
                    **common,
                )
            )
        elif i % 4 == 2:
            schema = StructuredOutputsParams(json=ITEMS_SCHEMA)
            params.append(SamplingParams(temperature=0.0, structured_outputs=schema, **common))
        else:
            params.append(SamplingParams(temperature=0.0, **common))
    return params


def load_serve(model: str | None, dtype: str, requests: list[Request], **kwargs):
    from serve import LLM, SamplingParams

    # Passes repeat the same prompts: a later pass must not find them in the prefix cache.
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, **kwargs)
    warmup = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": requests[0].prompt_token_ids[:8]}], [warmup], use_tqdm=False)
    return llm


def run_serve(llm, requests: list[Request], params: list, name: str = "serve") -> Result:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_output = sum(len(out.outputs[0].token_ids) for out in outputs)
    expected = sum(r.num_output_tokens for r in requests)
    if num_output != expected:
        print(f"  {name}: {num_output} output tokens of {expected} asked for")
    return Result.of(name, elapsed, requests, num_output)


def hf_generate(model, batch: list[Request], pad_token_id: int) -> None:
    """One static batch: left-padded prompts, decoded to the batch's longest output."""
    longest = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, r in enumerate(batch):  # left padding: every prompt ends at the same column
        input_ids[row, longest - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, longest - len(r.prompt_token_ids) :] = 1
    num_new = max(r.num_output_tokens for r in batch)
    output_ids = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        pad_token_id=pad_token_id,
    )
    assert output_ids.shape == (len(batch), longest + num_new), output_ids.shape


def release(llm) -> None:
    """Stop serve and give back its GPU memory (the KV cache takes most of the card), so
    HF can load the same weights after it."""
    import gc

    llm.shutdown()
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_hf(model, requests: list[Request], batch_size: int, pad_token_id: int) -> Result:
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            hf_generate(model, requests[i : i + batch_size], pad_token_id)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    useful = sum(r.num_output_tokens for r in requests)
    return Result.of(f"hf (batch {batch_size})", elapsed, requests, useful)


def run_hf_sweep(model_dir: Path, dtype: str, requests: list[Request], tokenizer, sizes) -> Result:
    """The best of HF static batching over the batch sizes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id
    hf_generate(model, [Request(requests[0].prompt_token_ids[:8], 2)], pad_token_id)  # warm-up
    best = None
    for batch_size in sizes:
        result = run_hf(model, requests, batch_size, pad_token_id)
        print(f"  {result.name}: {result.output_tokens_per_s:.1f} output tok/s")
        if best is None or result.output_tokens_per_s > best.output_tokens_per_s:
            best = result
    return best


def machine_info() -> dict:
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def print_table(results: list[Result]) -> None:
    print(f"{'engine':<16}{'elapsed s':>10}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}")
    for r in results:
        print(
            f"{r.name:<16}{r.elapsed_s:>10.2f}{r.requests_per_s:>9.2f}"
            f"{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>13.1f}"
        )


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args()
    import torch
    from transformers import AutoTokenizer

    if args.compare_eager and not torch.cuda.is_available():
        raise SystemExit("--compare-eager compares CUDA graphs with eager steps: it needs a GPU")

    info = machine_info()
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = make_requests(args, tokenizer)
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    num_output = sum(r.num_output_tokens for r in requests)
    print(
        f"model={model_dir} requests={len(requests)} prompt_tokens={num_prompt} "
        f"output_tokens={num_output}"
    )

    serve = mixed = parallel = eager = None
    serial: list[Result] = []
    if not args.skip_serve:
        llm = load_serve(args.model, args.dtype, requests)
        serve = run_serve(llm, requests, plain_params(requests))
        if args.decoding_mix:
            mixed = run_serve(llm, requests, mixed_params(requests), "serve (mix)")
        if args.compare_serial:
            serial_llm = load_serve(args.model, args.dtype, requests, async_scheduling=False)
            serial.append(run_serve(serial_llm, requests, plain_params(requests), "serial"))
            again = run_serve(llm, requests, plain_params(requests))
            serial.append(run_serve(serial_llm, requests, plain_params(requests), "serial"))
            release(serial_llm)
            serve = max(serve, again, key=lambda r: r.output_tokens_per_s)
        if args.compare_tp:
            llm.shutdown()
            tp_llm = load_serve(
                args.model, args.dtype, requests, tensor_parallel_size=args.compare_tp
            )
            name = f"serve tp={args.compare_tp}"
            parallel = run_serve(tp_llm, requests, plain_params(requests), name)
            tp_llm.shutdown()
        release(llm)
        del llm
        if args.compare_eager:
            eager_llm = load_serve(args.model, args.dtype, requests, cuda_graphs=False)
            eager = run_serve(eager_llm, requests, plain_params(requests), "serve eager")
            release(eager_llm)
            del eager_llm
    sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    hf = None if args.skip_hf else run_hf_sweep(model_dir, args.dtype, requests, tokenizer, sizes)
    best_serial = max(serial, key=lambda r: r.output_tokens_per_s) if serial else None
    results = [r for r in (serve, mixed, best_serial, parallel, eager, hf) if r is not None]
    print_table(results)
    serial_ratio = (
        serve.output_tokens_per_s / best_serial.output_tokens_per_s if best_serial else None
    )
    if serial_ratio is not None:
        print(f"async / serial steps output tokens/s (best of two each): {serial_ratio:.2f}x")
    graphs_ratio = None
    if eager is not None and serve is not None:
        graphs_ratio = serve.output_tokens_per_s / eager.output_tokens_per_s
        print(f"CUDA graphs / eager output tokens/s: {graphs_ratio:.2f}x")
    tp_ratio = parallel.output_tokens_per_s / serve.output_tokens_per_s if parallel else None
    if tp_ratio is not None:
        print(f"tp={args.compare_tp} / one rank output tokens/s: {tp_ratio:.2f}x")
    ratio = serve.output_tokens_per_s / hf.output_tokens_per_s if serve and hf else None
    if ratio is not None:
        print(f"serve / HF output tokens/s: {ratio:.2f}x")
    mix_ratio = mixed.output_tokens_per_s / serve.output_tokens_per_s if mixed else None
    if mix_ratio is not None:
        print(f"mixed decoding controls / plain output tokens/s: {mix_ratio:.2f}x")
    if args.json:
        payload = {
            "machine": info,
            "args": vars(args),
            "results": [r.as_dict() for r in results],
            "serve_over_hf_output_tokens_per_s": ratio,
            "mix_over_plain_output_tokens_per_s": mix_ratio,
            "async_over_serial_output_tokens_per_s": serial_ratio,
            "tp_over_one_rank_output_tokens_per_s": tp_ratio,
            "graphs_over_eager_output_tokens_per_s": graphs_ratio,
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
