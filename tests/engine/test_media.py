"""Image URLs read as vLLM reads them (serve/engine/media.py): data URLs, http(s) fetched
from a local server within the timeout and the byte cap, file URLs only under the allowed
directory. Every failure is a ValueError that says what was wrong. No model, no network
beyond 127.0.0.1."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from image_fixtures import closed_port, data_url, image_server, png_bytes
from PIL import Image
from tiny_models import random_image

from serve.engine.image_inputs import ImageInputs
from serve.engine.media import FETCH_TIMEOUT_VARIABLE, MediaLoader, decode_image, to_rgb

IMAGE = random_image(7)


def _same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == b.mode and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def served():
    with image_server(slow_s=5.0) as server:
        server.files["/cat.png"] = png_bytes(IMAGE)
        yield server


# -- data URLs ----------------------------------------------------------------------------


def test_a_data_url_gives_its_image():
    assert _same_pixels(MediaLoader().load_image(data_url(IMAGE)), IMAGE)
    jpeg = io.BytesIO()
    IMAGE.save(jpeg, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg.getvalue()).decode()
    assert MediaLoader().load_image(url).size == IMAGE.size


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("data:image/png;base64,!!not base64!!", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"hello").decode(), "not an image"),
        ("data:image/png;base64," + base64.b64encode(png_bytes(IMAGE)[:200]).decode(), "decoded"),
        ("data:image/png,rawbytes", "not base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:image/png;base64", "no ','"),
        ("ftp://example.com/cat.png", "must be a data:"),
        ("cat.png", "must be a data:"),
        ("", "non-empty"),
    ],
    ids=[
        "bad-base64",
        "not-an-image",
        "truncated",
        "not-base64",
        "text",
        "no-comma",
        "ftp",
        "bare",
        "empty",
    ],
)
def test_bad_urls_are_value_errors_that_say_why(url, said):
    with pytest.raises(ValueError, match=said):
        MediaLoader().load_image(url)


def test_a_data_url_past_the_byte_cap_is_refused_before_decoding():
    with pytest.raises(ValueError, match="larger than"):
        MediaLoader(max_bytes=1024).load_image(data_url(random_image(1, 200, 200)))


def test_transparency_lies_over_white_and_eps_is_not_opened():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent
    buffer = io.BytesIO()
    rgba.save(buffer, format="PNG")
    loaded = decode_image(buffer.getvalue())
    assert loaded.mode == "RGB" and loaded.getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(IMAGE) is IMAGE
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n")


def test_a_long_thin_image_is_refused():
    """Image processors resize the short side up: 1 x 1000 would become 28 x 28,000."""
    with pytest.raises(ValueError, match="200-fold"):
        decode_image(png_bytes(Image.new("RGB", (1000, 1))))
    with pytest.raises(ValueError, match="200-fold"):
        ImageInputs.text_only("m").load(Image.new("RGB", (1, 1000)))


# -- http(s) ------------------------------------------------------------------------------


def test_an_http_url_is_fetched(served):
    assert _same_pixels(MediaLoader().load_image(f"{served.url}/cat.png"), IMAGE)


def test_fetch_failures_are_quick_value_errors(served):
    loader = MediaLoader(fetch_timeout_s=1.0, max_bytes=1 << 20)
    cases = [
        (f"{served.url}/missing.png", "HTTP 404"),
        (f"http://127.0.0.1:{closed_port()}/cat.png", "failed"),
        (f"{served.url}/slow", "timed out after 1 s"),
        (f"{served.url}/huge", "larger than 1 MiB"),
        (f"{served.url}/endless", "larger than 1 MiB"),
        (f"{served.url}/to-ftp", "non-HTTP"),
    ]
    for url, said in cases:
        start = time.monotonic()
        with pytest.raises(ValueError, match=said):
            loader.load_image(url)
        assert time.monotonic() - start < 4.0, url


def test_the_timeout_is_vllms_variable(monkeypatch):
    assert MediaLoader.create(None, {}).fetch_timeout_s == 5.0
    assert MediaLoader.create(None, {FETCH_TIMEOUT_VARIABLE: "0.5"}).fetch_timeout_s == 0.5
    with pytest.raises(ValueError, match=FETCH_TIMEOUT_VARIABLE):
        MediaLoader.create(None, {FETCH_TIMEOUT_VARIABLE: "soon"})


# -- file:// ------------------------------------------------------------------------------


def test_file_urls_need_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(IMAGE))
    (tmp_path / "secret.png").write_bytes(png_bytes(IMAGE))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    url = f"file://{allowed}/cat.png"
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        MediaLoader().load_image(url)
    loader = MediaLoader.create(str(allowed), {})
    assert _same_pixels(loader.load_image(url), IMAGE)
    for escaping in (f"file://{allowed}/../secret.png", f"file://{allowed}/link.png"):
        with pytest.raises(ValueError, match="must be under"):
            loader.load_image(escaping)
    with pytest.raises(ValueError, match="No such file"):
        loader.load_image(f"file://{allowed}/absent.png")
    with pytest.raises(ValueError, match="other host"):
        loader.load_image(f"file://example.com{allowed}/cat.png")


# -- counts -------------------------------------------------------------------------------


def test_counts_are_checked_against_the_model_and_the_limit():
    text_only = ImageInputs.text_only("tiny-llama")
    text_only.check_count(0)
    with pytest.raises(ValueError, match="tiny-llama takes no images"):
        text_only.check_count(1)
    takes_two = ImageInputs("tiny-llava", object(), MediaLoader(), 2)  # any processor
    takes_two.check_count(2)
    with pytest.raises(ValueError, match=r"at most 2 image\(s\).*this one has 3"):
        takes_two.check_count(3)
    with pytest.raises(ValueError, match="no images here"):
        ImageInputs("tiny-llava", object(), MediaLoader(), 0).check_count(1)
