"""A chat request's images, for the chat handler: counted against what the model and the
server take (`ImageInputs`), read from their URLs on threads of their own, and widened
into the prompt. Reading waits on the network for up to $VLLM_IMAGE_FETCH_TIMEOUT
seconds: on the event loop it would stall every stream, and on the prompt thread every
other request's prompt. Every refusal is a 400 that says why, naming `messages`."""

from __future__ import annotations

import asyncio
import concurrent.futures

from PIL import Image

from serve.api.errors import APIError
from serve.api.protocol import ChatCompletionRequest
from serve.engine.image_inputs import ImageInputs
from serve.multimodal_inputs import MultiModalInput

# A request's images are read at once, each on a thread (decoding runs mostly outside
# the GIL); requests beyond the threads wait their turn.
_MEDIA_THREADS = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="api-media")


def check_images(inputs: ImageInputs, request: ChatCompletionRequest) -> list[str]:
    """The request's image URLs, once the model and the limit take that many."""
    urls = request.image_urls
    try:
        inputs.check_count(len(urls))
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return urls


async def load_images(inputs: ImageInputs, request: ChatCompletionRequest) -> list[Image.Image]:
    """The request's images, read concurrently off the event loop."""
    urls = check_images(inputs, request)
    if not urls:
        return []
    loop = asyncio.get_running_loop()
    reads = [loop.run_in_executor(_MEDIA_THREADS, inputs.load, url) for url in urls]
    try:
        return list(await asyncio.gather(*reads))
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def widen_prompt(
    inputs: ImageInputs,
    request: ChatCompletionRequest,
    token_ids: list[int],
    images: list[Image.Image],
) -> tuple[list[int], tuple[MultiModalInput, ...]]:
    """The rendered prompt with its images' placeholders widened, and the images as the
    engine takes them (`ImageInputs.process`)."""
    check_images(inputs, request)
    try:
        token_ids, mm_inputs = inputs.process(token_ids, images, request.mm_processor_kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    if mm_inputs and request.truncate_prompt_tokens is not None:
        raise APIError(
            400,
            "truncate_prompt_tokens cannot cut a prompt with images (an image's tokens "
            "would be cut apart); leave it out of such requests.",
            param="truncate_prompt_tokens",
        )
    return token_ids, mm_inputs
