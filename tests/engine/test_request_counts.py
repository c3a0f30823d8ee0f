"""A request's prompt tokens found in the prefix cache and its preemptions, from the
scheduler to the front end: `RequestOutput.num_cached_tokens` (vLLM's field) and the
request metrics (prompt_tokens_cached, request_num_preemptions)."""

from __future__ import annotations

from tiny_models import build_tokenizer, random_prompts

from serve import LLM, SamplingParams
from serve.engine.output_processor import OutputProcessor
from serve.scheduler.output_deltas import RequestDelta, SeqDelta
from serve.sequence import FinishReason

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_outputs_and_metrics_take_the_cores_counts():
    processor = OutputProcessor(build_tokenizer())
    processor.add_request("r", None, [5, 6, 7, 8, 9], SamplingParams(max_tokens=2, stop=["!"]))
    counts = {"num_cached_tokens": 4, "num_preemptions": 1}
    first = processor.process([RequestDelta("r", [SeqDelta(0, [11], None, None)], False, **counts)])
    assert first.outputs[0].num_cached_tokens == 4
    counts["num_preemptions"] = 2  # preempted again before its last token
    last = SeqDelta(0, [12], None, None, FinishReason.LENGTH)
    (out,) = processor.process([RequestDelta("r", [last], True, **counts)]).outputs
    assert out.finished and out.num_cached_tokens == 4
    snap = processor.metrics.snapshot()
    assert (snap.prompt_tokens, snap.prompt_tokens_cached) == (5, 4)
    preemptions = snap.histograms["request_num_preemptions"]
    assert (preemptions.count, preemptions.total) == (1, 2)


def test_the_same_prompt_twice_reports_its_cached_tokens(tiny_llama):
    llm = LLM(model=str(tiny_llama), block_size=4, kv_cache_memory="4MiB", swap_space=0.001)
    prompt = {"prompt_token_ids": random_prompts(512, 1, 30, 30, seed=3)[0]}
    (first,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    (second,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    hits = 28  # its full blocks but the one with its last token, whose logits it needs
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, hits)
    assert llm.stats().prefix_cache_hits == hits
    snap = llm.output_processor.metrics.snapshot()
    assert (snap.prompt_tokens, snap.prompt_tokens_cached) == (60, hits)


def test_each_finished_request_observes_its_preemptions(tiny_llama):
    # 24 blocks x 4 tokens, while the 8 requests need up to 8 x 48: they preempt each other.
    llm = LLM(model=str(tiny_llama), block_size=4, num_gpu_blocks_override=24)
    prompts = random_prompts(512, 8, 10, 40, seed=21)
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    num_preemptions = llm.stats().num_preemptions
    assert num_preemptions > 0
    h = llm.output_processor.metrics.snapshot().histograms["request_num_preemptions"]
    assert (h.count, h.total) == (len(prompts), num_preemptions)
    assert llm.stats().iteration_tokens.count > 0
