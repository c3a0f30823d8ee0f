"""What a step's messages cost to cross a process boundary: bytes, encode and decode time.

The multiprocess executor encodes each SchedulerOutput once and sends the bytes to every
rank; rank 0 sends a ModelRunnerOutput back; a core process sends the front end the
step's token deltas (list[RequestDelta], msgspec structs). This compares two encodings
of those messages on realistic steps:

- pickle (protocol 5): any Python object; decodes into the same dataclasses;
- msgspec msgpack: a typed decoder builds the dataclasses (and checks their field types).

    python benchmarks/step_message.py
    python benchmarks/step_message.py --decodes 512 --prompts 128 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta, SeqDelta
from serve.step import ModelRunnerOutput, NewSequence, ScheduledSequence, SchedulerOutput

BLOCK_SIZE = 16
VOCAB_SIZE = 49152


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decodes", type=int, default=256, help="sequences in the decode step")
    p.add_argument("--context-len", type=int, default=1000, help="their tokens so far")
    p.add_argument("--prompts", type=int, default=64, help="new prompts in the prefill step")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--top-logprobs", type=int, default=5, help="per token, in the output")
    p.add_argument("--repeats", type=int, default=200)
    return p.parse_args()


def decode_step(num_seqs: int, context_len: int) -> SchedulerOutput:
    """A steady decode step: one token each; one sequence in 16 starts a new block."""
    scheduled = [
        ScheduledSequence(
            seq_id=i,
            start=context_len + i,
            num_new_tokens=1,
            table_start=(context_len + i) // BLOCK_SIZE,
            block_ids=[1000 + i] if (context_len + i) % BLOCK_SIZE == 0 else [],
            is_sampled=True,
        )
        for i in range(num_seqs)
    ]
    return SchedulerOutput(scheduled=scheduled)


def prefill_step(num_prompts: int, prompt_len: int, rng: random.Random) -> SchedulerOutput:
    """New prompts, each computed whole, with their sampling parameters."""
    num_blocks = -(-prompt_len // BLOCK_SIZE)
    new_seqs, scheduled = [], []
    for i in range(num_prompts):
        params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, stop=["\n\n"])
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)]
        new_seqs.append(NewSequence(i, f"cmpl-{i:08x}", prompt, params, seed=None))
        blocks = list(range(i * num_blocks, (i + 1) * num_blocks))
        scheduled.append(ScheduledSequence(i, 0, prompt_len, 0, blocks, is_sampled=True))
    return SchedulerOutput(scheduled=scheduled, new_seqs=new_seqs)


def sampled_output(num_seqs: int, top_logprobs: int, rng: random.Random) -> ModelRunnerOutput:
    top = [
        {rng.randrange(VOCAB_SIZE): -rng.random() * 5 for _ in range(top_logprobs)}
        for _ in range(num_seqs)
    ]
    return ModelRunnerOutput(
        seq_ids=list(range(num_seqs)),
        token_ids=[rng.randrange(VOCAB_SIZE) for _ in range(num_seqs)],
        logprobs=[-rng.random() for _ in range(num_seqs)],
        top_logprobs=top if top_logprobs else [None] * num_seqs,
        prepare_s=0.001,
        forward_s=0.02,
        sample_s=0.002,
    )


def token_deltas(num_seqs: int, top_logprobs: int, rng: random.Random) -> list[RequestDelta]:
    """What a core process sends the front end after a decode step: one new token each
    (with its logprob and top logprobs when `top_logprobs`)."""
    deltas = []
    for i in range(num_seqs):
        top = None
        if top_logprobs:
            top = [{rng.randrange(VOCAB_SIZE): -rng.random() * 5 for _ in range(top_logprobs)}]
        logprobs = [-rng.random()] if top_logprobs else None
        seq = SeqDelta(0, [rng.randrange(VOCAB_SIZE)], logprobs, top)
        deltas.append(RequestDelta(f"cmpl-{i:032x}-0", [seq], False))
    return deltas


@dataclass
class Codec:
    name: str
    encode: Callable[[object], bytes]
    decode: Callable[[bytes], object]


def codecs(message_type: type) -> list[Codec]:
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(message_type)
    return [
        Codec("pickle", lambda m: pickle.dumps(m, protocol=5), pickle.loads),
        Codec("msgspec", encoder.encode, decoder.decode),
    ]


def best_time_us(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` runs (the least disturbed by the machine's other load)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(label: str, message: object, repeats: int, message_type: object = None) -> None:
    for codec in codecs(message_type or type(message)):
        data = codec.encode(message)
        assert codec.decode(data) == message, f"{codec.name} does not round-trip {label}"
        encode_us = best_time_us(lambda c=codec: c.encode(message), repeats)
        decode_us = best_time_us(lambda c=codec, d=data: c.decode(d), repeats)
        print(
            f"{label:<34} {codec.name:<8} {len(data):>10,} B {encode_us:>10.1f} "
            f"{decode_us:>10.1f} {encode_us + decode_us:>10.1f}"
        )


def main() -> None:
    args = parse_args()
    rng = random.Random(0)
    print(
        f"{'message':<34} {'codec':<8} {'size':>12} {'encode µs':>10} {'decode µs':>10} {'total µs':>10}"
    )
    measure(
        f"decode step, {args.decodes} seqs",
        decode_step(args.decodes, args.context_len),
        args.repeats,
    )
    measure(
        f"prefill, {args.prompts} x {args.prompt_len} tokens",
        prefill_step(args.prompts, args.prompt_len, rng),
        max(1, args.repeats // 10),
    )
    measure(f"output, {args.decodes} tokens", sampled_output(args.decodes, 0, rng), args.repeats)
    measure(
        f"output, {args.decodes} + top-{args.top_logprobs}",
        sampled_output(args.decodes, args.top_logprobs, rng),
        args.repeats,
    )
    for top in (0, args.top_logprobs):
        measure(
            f"deltas, {args.decodes} tokens" + (f" + top-{top}" if top else ""),
            token_deltas(args.decodes, top, rng),
            args.repeats,
            list[RequestDelta],
        )


if __name__ == "__main__":
    main()
