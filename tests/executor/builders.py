"""Configs and steps for the executor tests, and what the fake workers report back."""

from __future__ import annotations

from executor.fake_workers import ROW_WIDTH

from serve.config import EngineConfig, ParallelConfig
from serve.sampling_params import SamplingParams
from serve.step import ModelRunnerOutput, NewSequence, ScheduledSequence, SchedulerOutput
from serve.worker.worker import WorkerConfig

WORKERS = "executor.fake_workers."  # + a class name: the worker_class argument


def make_config(world_size: int, backend: str) -> WorkerConfig:
    engine = EngineConfig(parallel=ParallelConfig(world_size, backend), device="cpu")
    return WorkerConfig(engine, model_path="unused", eos_token_ids=(0,))


def decode_step(num_seqs: int) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled=[ScheduledSequence(i, 100 + i, 1, 7, [], True) for i in range(num_seqs)]
    )


def prefill_step(num_prompts: int, prompt_len: int) -> SchedulerOutput:
    """64 x 512 tokens encode to ~140 KB: more than a pipe's 64 KiB buffer."""
    num_blocks = -(-prompt_len // 16)
    new_seqs, scheduled = [], []
    for i in range(num_prompts):
        prompt = [(i * 7919 + t) % 50000 for t in range(prompt_len)]
        params = SamplingParams(temperature=0.5, stop=["\n"])
        new_seqs.append(NewSequence(i, f"req-{i}", prompt, params, seed=i))
        block_ids = list(range(i * num_blocks, (i + 1) * num_blocks))
        scheduled.append(ScheduledSequence(i, 0, prompt_len, 0, block_ids, True))
    return SchedulerOutput(scheduled=scheduled, new_seqs=new_seqs)


def steps_of_every_size() -> list[SchedulerOutput]:
    return [decode_step(256), prefill_step(64, 512), decode_step(3), SchedulerOutput()]


def ranks_rows(output: ModelRunnerOutput) -> list[list[int]]:
    """What each rank saw, by rank: [step index, digest, num_blocks, num_cpu_blocks]."""
    ids = output.token_ids
    return [ids[i : i + ROW_WIDTH] for i in range(0, len(ids), ROW_WIDTH)]
