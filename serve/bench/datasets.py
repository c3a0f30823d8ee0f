"""What `serve bench` sends: seeded request sets with known prompt and output lengths.

- random: prompts of random token ids and output lengths drawn uniformly from ranges
  (the same seed gives the same requests as benchmarks/throughput.py);
- sharegpt: the first human turn of each conversation in a ShareGPT-format JSON file as
  the prompt, the length of the reply that followed as the output length;
- prefix: groups of requests whose prompts share a long prefix (a system prompt, a
  document), each with a short suffix of its own: what prefix caching is for.

Output lengths are asked for with `ignore_eos` by default, so every server does the same
work whatever its model would say.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Request:
    prompt: list[int] | str  # token ids, or text the server tokenizes
    num_output_tokens: int
    # Text prompts: their length as counted by the tokenizer the set was built with.
    text_prompt_tokens: int = field(default=0, compare=False)

    @property
    def prompt_token_ids(self) -> list[int]:
        if not isinstance(self.prompt, list):
            raise TypeError("this request's prompt is text, not token ids")
        return self.prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else self.text_prompt_tokens


def random_requests(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    token_ids: Sequence[int],
    seed: int = 0,
) -> list[Request]:
    """Lengths uniform in the inclusive ranges; `token_ids` are the ids prompts draw from
    (leave out the special tokens)."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.choice(token_ids) for _ in range(rng.randint(*prompt_len))],
            rng.randint(*output_len),
        )
        for _ in range(num_requests)
    ]


def prefix_requests(
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    token_ids: Sequence[int],
    seed: int = 0,
) -> list[Request]:
    """`num_requests` prompts in `num_prefixes` groups: each group's prompts start with
    the same `prefix_len` tokens and end with `suffix_len` of their own; shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.choice(token_ids) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    requests = [
        Request(
            prefixes[i % num_prefixes] + [rng.choice(token_ids) for _ in range(suffix_len)],
            output_len,
        )
        for i in range(num_requests)
    ]
    rng.shuffle(requests)
    return requests


def sharegpt_requests(
    path: Path,
    num_requests: int,
    count_tokens: Callable[[str], int],
    max_len: int | None = None,
    seed: int = 0,
) -> list[Request]:
    """ShareGPT format: a JSON list of {"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}. Conversations are shuffled (seeded); those
    whose prompt or reply is under 4 tokens, or whose prompt and reply together pass
    `max_len`, are skipped (as vLLM's benchmark does)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the ShareGPT file {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        if first.get("from") != "human" or reply.get("from") != "gpt":
            continue
        pairs.append((str(first.get("value", "")), str(reply.get("value", ""))))
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        if len(requests) == num_requests:
            break
        num_prompt, num_output = count_tokens(prompt), count_tokens(reply)
        if num_prompt < 4 or num_output < 4:
            continue
        if max_len is not None and num_prompt + num_output > max_len:
            continue
        requests.append(Request(prompt, num_output, num_prompt))
    if not requests:
        raise ValueError(f"{path}: no usable human→gpt conversation in it")
    return requests
