"""The front end's work per streamed token as outputs grow: the output processor (text,
stop strings, DELTA outputs) and the stream's bookkeeping, in process, no server.

    python benchmarks/stream_outputs.py                  # 512x128, 16x4096, 4x16384
    python benchmarks/stream_outputs.py --loads 4x32768

A load `SxL` is S streams of L tokens, fed one token a step to all S, as the core's
messages bring them. Prints microseconds a token in each quarter of the output: flat
means a step costs the same at the 100th token and the 10,000th. The tokenizer is the
default model's.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from transformers import AutoTokenizer

from serve.api.streaming import StreamState
from serve.engine.output_processor import OutputProcessor
from serve.models.default_model import resolve_default_model
from serve.outputs import OutputKind
from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta, SeqDelta

WORDS = "the quick brown fox jumps over a lazy dog while rivers run to the sea".split()
PROMPT = [1, 2, 3, 4, 5, 6]


def per_quarter_us(tokenizer, streams: int, length: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    pieces = [tokenizer.encode(" " + w, add_special_tokens=False) for w in WORDS]
    outputs = []
    for _ in range(streams):
        ids: list[int] = []
        while len(ids) < length:
            ids += rng.choice(pieces)
        outputs.append(ids[:length])
    processor = OutputProcessor(tokenizer)
    states = {}
    params = SamplingParams(max_tokens=length, ignore_eos=True)
    for s in range(streams):
        processor.add_request(f"r{s}", None, PROMPT, params, OutputKind.DELTA)
        states[f"r{s}"] = StreamState(1)
    quarter = length // 4
    marks = [time.perf_counter()]
    for i in range(length):
        step = processor.process(
            [
                RequestDelta(f"r{s}", [SeqDelta(0, [outputs[s][i]], None, None)], False)
                for s in range(streams)
            ]
        )
        for out in step.outputs:
            states[out.request_id].take(0, out.outputs[0])
        if (i + 1) % quarter == 0:
            marks.append(time.perf_counter())
    return [(b - a) / (streams * quarter) * 1e6 for a, b in zip(marks, marks[1:])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loads", default="512x128,16x4096,4x16384", help="SxL, comma-separated")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_default_model())
    loads = []
    for load in args.loads.split(","):
        try:
            streams, length = (int(v) for v in load.split("x"))
        except ValueError:
            p.error(f"--loads: {load!r} is not STREAMSxLENGTH")
        if streams < 1 or length < 4 or length % 4:
            p.error(f"--loads: {load!r} needs a stream and a length that is a multiple of 4")
        loads.append((load, streams, length))
    for load, streams, length in loads:
        gc.collect()
        quarters = per_quarter_us(tokenizer, streams, length)
        print(
            f"{load:>10}: us a token by quarter of the output "
            + " / ".join(f"{q:.1f}" for q in quarters)
        )


if __name__ == "__main__":
    main()
