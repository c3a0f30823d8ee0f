"""What `serve bench` sends: seeded request sets with known prompt and output lengths.

- random: prompts of random token ids and output lengths drawn uniformly from ranges
  (the same seed gives the same requests as benchmarks/throughput.py);
- sharegpt: the first human turn of each conversation in a ShareGPT-format JSON file as
  the prompt, the length of the reply that followed as the output length;
- prefix: groups of requests whose prompts share a long prefix (a system prompt, a
  document), each with a short suffix of its own: what prefix caching is for;
- random-image: chat requests for vision-language models, random words and images of
  random pixels (PNG data URLs) of seeded sizes (vLLM's random-mm, images only).

Output lengths are asked for with `ignore_eos` by default, so every server does the same
work whatever its model would say.
"""

from __future__ import annotations

import base64
import io
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Words that are one token each, a leading space included, in the BPE vocabularies of
# common models: a random-image prompt of n words is about n text tokens.
WORDS = tuple(
    "the of and to in is for on that with as it at by from this be are was or an not "
    "but all can one has more new time year day way work life world hand part place "
    "case week group number point home water room state name night side line end".split()
)
MAX_IMAGE_SIDE = 8192


@dataclass(frozen=True)
class Request:
    prompt: list[int] | str  # token ids, or text the server tokenizes
    num_output_tokens: int
    # Text prompts: their length as counted when the set was built (random-image: its
    # words, an estimate); the server's count replaces it once the request is answered.
    text_prompt_tokens: int = field(default=0, compare=False)
    # With images, the request is one chat message (`/v1/chat/completions`): the prompt
    # text, then these images (data URLs).
    image_urls: tuple[str, ...] = field(default=(), repr=False)

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


@dataclass(frozen=True)
class ImageSizes:
    """The sizes random images are drawn from: width and height each uniform between
    `least` and `most`, inclusive. Written `WxH` (one size) or `WxH-WxH` (a range)."""

    least: tuple[int, int]  # (width, height) in pixels
    most: tuple[int, int]

    @classmethod
    def parse(cls, text: str) -> ImageSizes:
        """Raises ValueError, saying what is wrong, for anything but `WxH[-WxH]` with
        sides from 1 to MAX_IMAGE_SIDE and the least size no larger than the most."""
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*(?:-\s*(\d+)x(\d+)\s*)?", text)
        if match is None:
            raise ValueError(f"not WxH or WxH-WxH (e.g. 336x336, 224x224-672x672): {text!r}")
        sides = [int(side) for side in match.groups() if side is not None]
        if any(not 1 <= side <= MAX_IMAGE_SIDE for side in sides):
            raise ValueError(f"image sides are 1 to {MAX_IMAGE_SIDE} pixels: {text!r}")
        least, most = (sides[0], sides[1]), (sides[-2], sides[-1])
        if least[0] > most[0] or least[1] > most[1]:
            raise ValueError(f"the first size is larger than the second: {text!r}")
        return cls(least, most)

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(self.least[0], self.most[0]), rng.randint(self.least[1], self.most[1])

    def __str__(self) -> str:
        text = f"{self.least[0]}x{self.least[1]}"
        return text if self.least == self.most else f"{text}-{self.most[0]}x{self.most[1]}"


def random_image_requests(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    image_sizes: ImageSizes,
    images_per_request: int = 1,
    seed: int = 0,
) -> list[Request]:
    """Chat requests: a text of random words (as many as a prompt length drawn from
    `prompt_len`; about a token each) followed by `images_per_request` images of random
    pixels, PNG data URLs, each of a size drawn from `image_sizes`. The prompt length
    reported is the server's count (usage), image tokens included."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*prompt_len))]
        num_output_tokens = rng.randint(*output_len)
        urls = tuple(_random_png_url(image_sizes.draw(rng), rng) for _ in range(images_per_request))
        requests.append(Request(" ".join(words), num_output_tokens, len(words), urls))
    return requests


def _random_png_url(size: tuple[int, int], rng: random.Random) -> str:
    # Random pixels do not compress: the most bytes an image of this size can cost.
    from PIL import Image  # Pillow, a dependency of serve; only this set needs it

    width, height = size
    image = Image.frombytes("RGB", size, rng.randbytes(width * height * 3))
    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii")


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
