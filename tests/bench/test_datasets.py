"""serve bench's request sets: seeded, with the lengths they promise; ranges checked."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from serve.bench.cli import main as bench_main
from serve.bench.datasets import (
    ImageSizes,
    prefix_requests,
    random_image_requests,
    random_requests,
    sharegpt_requests,
)

TOKENS = range(10, 500)


def test_random_requests_are_seeded_and_within_their_ranges():
    a = random_requests(20, (4, 9), (2, 6), TOKENS, seed=5)
    assert a == random_requests(20, (4, 9), (2, 6), TOKENS, seed=5)
    assert a != random_requests(20, (4, 9), (2, 6), TOKENS, seed=6)
    assert all(4 <= r.num_prompt_tokens <= 9 and 2 <= r.num_output_tokens <= 6 for r in a)
    assert all(10 <= t < 500 for r in a for t in r.prompt_token_ids)
    # the ranges are inclusive and both ends are drawn
    assert {len(r.prompt) for r in random_requests(200, (4, 5), (1, 1), TOKENS)} == {4, 5}


def test_prefix_requests_share_their_group_prefix_only():
    requests = prefix_requests(12, 3, prefix_len=16, suffix_len=4, output_len=5, token_ids=TOKENS)
    assert len(requests) == 12 and all(r.num_output_tokens == 5 for r in requests)
    prefixes = {tuple(r.prompt[:16]) for r in requests}
    assert len(prefixes) == 3
    for prefix in prefixes:
        group = [r for r in requests if tuple(r.prompt[:16]) == prefix]
        assert len(group) == 4
        assert all(len(r.prompt) == 20 for r in group)


def _decode(url: str) -> Image.Image:
    header, data = url.split(",", 1)
    assert header == "data:image/png;base64"
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    assert image.format == "PNG" and image.mode == "RGB"
    return image


def test_random_image_requests_are_seeded_and_their_images_have_the_asked_sizes():
    one_size = ImageSizes.parse("24x16")
    a = random_image_requests(6, (3, 7), (2, 5), one_size, images_per_request=2, seed=3)
    assert a == random_image_requests(6, (3, 7), (2, 5), one_size, images_per_request=2, seed=3)
    b = random_image_requests(6, (3, 7), (2, 5), one_size, images_per_request=2, seed=4)
    assert [r.image_urls for r in a] != [r.image_urls for r in b]
    for request in a:
        assert len(request.image_urls) == 2 and isinstance(request.prompt, str)
        assert 3 <= len(request.prompt.split()) == request.num_prompt_tokens <= 7
        assert 2 <= request.num_output_tokens <= 5
        assert all(_decode(url).size == (24, 16) for url in request.image_urls)
    # random pixels: no two images alike
    assert len({url for r in a for url in r.image_urls}) == 12

    ranged = ImageSizes.parse("10x20-13x22")
    sizes = [
        _decode(url).size
        for r in random_image_requests(40, (1, 1), (1, 1), ranged, seed=0)
        for url in r.image_urls
    ]
    assert {w for w, _ in sizes} == {10, 11, 12, 13} and {h for _, h in sizes} == {20, 21, 22}


def test_image_sizes_read_one_size_or_a_range():
    assert ImageSizes.parse("336x336") == ImageSizes((336, 336), (336, 336))
    assert ImageSizes.parse("224x160-672x480") == ImageSizes((224, 160), (672, 480))
    assert str(ImageSizes.parse("336x336")) == "336x336"
    assert str(ImageSizes.parse("224x160-672x480")) == "224x160-672x480"


def _conversation(prompt: str, reply: str) -> dict:
    return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


def test_sharegpt_takes_first_turns_and_skips_what_vllm_skips(tmp_path):
    data = [
        _conversation("one two three four five", "a b c d e f"),
        _conversation("too short", "a b c d e"),  # prompt under 4 tokens
        _conversation("one two three four", "no"),  # reply under 4 tokens
        {"conversations": [{"from": "gpt", "value": "x y z w"}, {"from": "human", "value": "q"}]},
        {"conversations": [{"from": "human", "value": "alone in here"}]},
        _conversation("w " * 50, "r " * 60),  # past max_len
        _conversation("six seven eight nine", "g h i j"),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(path, 10, lambda text: len(text.split()), max_len=100, seed=1)
    got = sorted((r.prompt, r.num_prompt_tokens, r.num_output_tokens) for r in requests)
    assert got == [("one two three four five", 5, 6), ("six seven eight nine", 4, 4)]
    assert len(sharegpt_requests(path, 1, lambda text: len(text.split()))) == 1


def test_sharegpt_says_what_is_wrong_with_a_bad_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the ShareGPT file"):
        sharegpt_requests(bad, 1, len)
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(bad, 1, len)
    bad.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(ValueError, match="no usable"):
        sharegpt_requests(bad, 1, len)
    bad.write_text(json.dumps([{"conversations": [5, 6]}]))  # turns that are not objects
    with pytest.raises(ValueError, match="no usable"):
        sharegpt_requests(bad, 1, len)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--max-output", "8"],
            "--min-output (16) must be at least 1 and at most --max-output (8)",
        ),
        (["--min-prompt", "0"], "--min-prompt (0) must be at least 1"),
        (["--num-requests", "0"], "argument --num-requests: must be at least 1, got 0"),
        (["--max-concurrency", "-1"], "argument --max-concurrency: must be at least 1"),
        (["--num-prefixes", "0"], "argument --num-prefixes: must be at least 1"),
        (["--request-rate", "nan"], "rates are positive numbers"),
        (["--vocab-size", "17"], "--vocab-size (17) must be above --min-token-id (17)"),
        (["--image-size", "336"], "argument --image-size: not WxH or WxH-WxH"),
        (["--image-size", "336x336-"], "argument --image-size: not WxH or WxH-WxH"),
        (["--image-size", "0x336"], "argument --image-size: image sides are 1 to 8192"),
        (["--image-size", "336x99999"], "argument --image-size: image sides are 1 to 8192"),
        (
            ["--image-size", "672x672-224x224"],
            "argument --image-size: the first size is larger than the second",
        ),
        (["--images-per-request", "0"], "argument --images-per-request: must be at least 1"),
        (
            ["--dataset", "random-image", "--min-prompt", "9", "--max-prompt", "8"],
            "--min-prompt (9) must be at least 1 and at most --max-prompt (8)",
        ),
    ],
)
def test_a_bad_setting_is_a_usage_error(capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--base-url", "http://127.0.0.1:9", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_compare_refuses_a_file_that_is_not_a_results_file(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"label": "x"}))
    assert bench_main(["--compare", str(other), "--output-dir", str(tmp_path)]) == 2
    assert "is not a serve bench results.json" in capsys.readouterr().err


def test_without_ignore_eos_a_request_that_stops_early_succeeds():
    """The model may stop at EOS: only forced lengths must match (every one that stopped
    early was counted as mismatched, and left out of throughput and latencies)."""
    from serve.bench.client import RequestResult
    from serve.bench.report import summarize

    stopped = RequestResult(8, 200, num_output_tokens=37, ttft_s=0.1, e2e_s=1.0)
    free = RequestResult(8, 200, num_output_tokens=37, ttft_s=0.1, e2e_s=1.0, forces_length=False)
    assert not stopped.is_success and free.is_success
    summary = summarize([free, free], duration_s=2.0)
    assert summary["num_successful"] == 2 and summary["num_mismatched"] == 0
    assert summary["num_output_tokens"] == 74
