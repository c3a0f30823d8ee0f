"""Images from the URLs a prompt names, read as vLLM reads them: `data:image/...;base64,`
URLs, `http(s)://` URLs fetched (within `VLLM_IMAGE_FETCH_TIMEOUT` seconds, 5 by default,
and `MAX_IMAGE_BYTES`), and `file://` URLs only under the `allowed_local_media_path`
directory. Every failure is a ValueError that says what was wrong (the server answers it
with a 400). The bytes are opened only as the still-image formats of `IMAGE_FORMATS` (no
format whose reader runs an external program), their EXIF orientation applied, and
made RGB with transparency over white, as vLLM and HF's image processors do.

Loading blocks (a fetch waits on the network): the server runs it on threads of its own
(`api/chat_images.py`), the offline `LLM` in the caller's thread.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

FETCH_TIMEOUT_VARIABLE = "VLLM_IMAGE_FETCH_TIMEOUT"  # vLLM's, in seconds
DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's default
# An image's encoded bytes, however it comes: a body past this is not read further, so a
# huge (or endless) response cannot fill memory. A data URL is also bounded by the
# server's --max-request-body-bytes.
MAX_IMAGE_BYTES = 32 * 1024 * 1024
# Decoded pixels (width * height): vLLM's VLLM_MAX_IMAGE_PIXELS default, which is also
# where Pillow refuses a "decompression bomb".
MAX_IMAGE_PIXELS = 178_956_970
# An image's long side over its short one: image processors resize the short side to a
# fixed length, so a 1 x 100,000 image (a few bytes) would become gigabytes of pixels.
# Qwen2-VL's processor refuses past the same bound.
MAX_ASPECT_RATIO = 200
# Pillow's readers for still images that decode in process (Pillow also opens EPS through
# Ghostscript, and formats that need external handlers: not those).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "ICO", "PPM", "TGA", "JPEG2000")
_READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class MediaLoader:
    """Reads images from URLs, under one policy: where files may be read from, how long a
    fetch may take, how many bytes an image may have."""

    allowed_local_media_path: Path | None = None  # resolved; None: file URLs refused
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def create(
        cls, allowed_local_media_path: str | Path | None, environ: Mapping[str, str] = os.environ
    ) -> MediaLoader:
        """The loader for the `allowed_local_media_path` setting, its fetch timeout from
        `$VLLM_IMAGE_FETCH_TIMEOUT` (seconds)."""
        text = environ.get(FETCH_TIMEOUT_VARIABLE, "").strip()
        try:
            timeout_s = float(text) if text else DEFAULT_FETCH_TIMEOUT_S
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise ValueError(
                f"${FETCH_TIMEOUT_VARIABLE} must be a positive number of seconds; got {text!r}."
            )
        folder = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        return cls(folder, timeout_s)

    def load_image(self, url: str) -> Image.Image:
        """The RGB image `url` names (ValueError: why it cannot be had)."""
        if not isinstance(url, str) or not url:
            raise ValueError(f"An image URL is a non-empty string; got {url!r:.60}.")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._data_url(url)
        elif scheme in ("http", "https"):
            data = self._fetch(url)
        elif scheme == "file":
            data = self._local_file(url)
        else:
            raise ValueError(
                f"Cannot read an image from {_shown(url)}: the URL must be a data: (base64), "
                "http:// or https:// URL, or file:// under --allowed-local-media-path."
            )
        return decode_image(data, _shown(url))

    def _data_url(self, url: str) -> bytes:
        # RFC 2397: data:[<mediatype>][;<param>]*[;base64],<data>
        spec, has_comma, payload = url[5:].partition(",")
        if not has_comma:
            raise ValueError(f"The data URL {_shown(url)} has no ',' before its data.")
        media_type, _, encoding = spec.rpartition(";")
        if encoding.lower() != "base64":
            raise ValueError(
                f"The data URL {_shown(url)} is not base64: images are taken as "
                "data:image/...;base64,<data>."
            )
        if media_type and not media_type.lower().startswith("image/"):
            raise ValueError(f"The data URL {_shown(url)} holds {media_type}, not an image.")
        if len(payload) > 4 * (self.max_bytes // 3 + 1):
            raise ValueError(_too_big(f"The data URL {_shown(url)}", self.max_bytes))
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"The data URL {_shown(url)} is not valid base64: {e}.") from None

    def _fetch(self, url: str) -> bytes:
        """The body at an http(s) URL within the byte cap and the timeout: the whole body's
        time is checked between reads (a server that sends a trickle is cut off), each
        connect or read waits at most the timeout too. Redirects: to http(s) URLs only."""
        deadline = time.monotonic() + self.fetch_timeout_s
        shown = _shown(url)
        request = urllib.request.Request(url, headers={"User-Agent": "serve"})
        try:
            with _OPENER.open(request, timeout=self.fetch_timeout_s) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise ValueError(_too_big(f"The image at {shown}", self.max_bytes))
                body = bytearray()
                while chunk := response.read(_READ_CHUNK):
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise ValueError(_too_big(f"The image at {shown}", self.max_bytes))
                    if time.monotonic() > deadline:
                        raise TimeoutError
        except urllib.error.HTTPError as e:
            raise ValueError(
                f"Fetching the image at {shown} failed: HTTP {e.code} {e.reason}."
            ) from None
        except TimeoutError:
            raise ValueError(
                f"Fetching the image at {shown} timed out after {self.fetch_timeout_s:g} s "
                f"(${FETCH_TIMEOUT_VARIABLE})."
            ) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise ValueError(
                    f"Fetching the image at {shown} timed out after {self.fetch_timeout_s:g} s "
                    f"(${FETCH_TIMEOUT_VARIABLE})."
                ) from None
            raise ValueError(f"Fetching the image at {shown} failed: {reason}.") from None
        except (OSError, http.client.HTTPException) as e:
            raise ValueError(f"Fetching the image at {shown} failed: {e!r}.") from None
        return bytes(body)

    def _local_file(self, url: str) -> bytes:
        folder = self.allowed_local_media_path
        if folder is None:
            raise ValueError(
                f"Cannot read {_shown(url)}: file:// URLs are read only under the server's "
                "--allowed-local-media-path (LLM(allowed_local_media_path=...)), which is not set."
            )
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"Cannot read {_shown(url)}: a file URL names no other host.")
        path = Path(urllib.request.url2pathname(parts.path)).resolve()
        if not path.is_relative_to(folder):
            raise ValueError(
                f"Cannot read {_shown(url)}: the file must be under --allowed-local-media-path "
                f"{folder}."
            )
        try:
            if path.stat().st_size > self.max_bytes:
                raise ValueError(_too_big(f"The file {path}", self.max_bytes))
            return path.read_bytes()
        except OSError as e:
            raise ValueError(f"Cannot read {_shown(url)}: {e.strerror or e}.") from None


def decode_image(data: bytes, source: str = "The image") -> Image.Image:
    """Encoded image bytes as an RGB PIL image (ValueError: not an image serve reads).
    Whatever a reader raises on these untrusted bytes is the image's fault, said so."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Exception as e:
        raise ValueError(
            f"{source} is not an image serve can read ({', '.join(IMAGE_FORMATS)}): {e}"
        ) from None
    check_image_size(image, source)  # from the header, before the pixels are decoded
    try:
        with contextlib.suppress(Exception):  # a malformed EXIF block: the image as stored
            image = ImageOps.exif_transpose(image)
        image.load()
        return to_rgb(image)
    except Exception as e:
        raise ValueError(f"{source} could not be decoded: {e}") from None


def check_image_size(image: Image.Image, source: str = "The image") -> None:
    """ValueError for an image too large, or too long and thin, to process."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{source} is {width}x{height} pixels, over the {MAX_IMAGE_PIXELS} taken.")
    if min(width, height) < 1 or max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ValueError(
            f"{source} is {width}x{height} pixels: its sides may differ at most "
            f"{MAX_ASPECT_RATIO}-fold."
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB, transparent pixels over white, as HF's image processors convert it
    (their `convert_to_rgb`) and vLLM loads it."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


class _HTTPRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """Redirects followed to http(s) URLs alone (urllib's own also follows ftp://)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(
                newurl, code, f"redirect to a non-HTTP URL ({_shown(newurl)})", headers, fp
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HTTPRedirectsOnly)


def _shown(url: str, limit: int = 80) -> str:
    """A URL as messages show it: a data URL's payload (or any long URL) cut short."""
    return url if len(url) <= limit else url[:limit] + "..."


def _too_big(what: str, max_bytes: int) -> str:
    return f"{what} is larger than {max_bytes // (1 << 20)} MiB, the most an image may have."
