"""vLLM-CPU's side of benchmarks/images.py, run with vLLM's own python (it imports nothing
of serve's): loads the model once, then times offline `LLM.generate` whenever asked.

    <vllm venv>/bin/python -P images_vllm.py JOB.json

`-P` keeps this folder off the module path (our kernels.py would shadow the `kernels`
package transformers looks for). JOB.json: {"model", "llm" (LLM keyword arguments),
"prompts" (texts, each with one `<image>`), "text_prompts" (the same without it),
"image_paths" (PNG files, one per prompt), "max_tokens"}.

Protocol: one JSON object a line on stdout, everything else (vLLM's logs, its engine
core's) sent to stderr. First {"ready": ..., settings vLLM chose}; then for each line
"images", "text" or "prefill" read on stdin (images.py's passes: the prompts with their
images, without them, with them and one output token), {"elapsed_s", "token_ids",
"num_prompt_tokens"} for the whole batch; "quit" ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    results = os.fdopen(os.dup(1), "w")  # ours alone: fd 1 becomes stderr for the rest
    os.dup2(2, 1)
    job = json.loads(open(sys.argv[1]).read())

    from PIL import Image
    from vllm import LLM, SamplingParams

    images = []
    for path in job["image_paths"]:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    llm = LLM(model=job["model"], **job["llm"])
    with_images = [
        {"prompt": prompt, "multi_modal_data": {"image": image}}
        for prompt, image in zip(job["prompts"], images)
    ]
    text = [{"prompt": prompt} for prompt in job["text_prompts"]]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    passes = {
        "images": (with_images, greedy(job["max_tokens"])),
        "text": (text, greedy(job["max_tokens"])),
        "prefill": (with_images, greedy(1)),
    }
    llm.generate(with_images[:2] + text[:1], greedy(2), use_tqdm=False)  # warm-up
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    ready = {
        "ready": True,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_num_seqs": scheduler.max_num_seqs,
    }
    print(json.dumps(ready), file=results, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        start = time.perf_counter()
        prompts, params = passes[command]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        reply = {
            "elapsed_s": elapsed,
            "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
            "num_prompt_tokens": [len(out.prompt_token_ids) for out in outputs],
        }
        print(json.dumps(reply), file=results, flush=True)


if __name__ == "__main__":
    main()
