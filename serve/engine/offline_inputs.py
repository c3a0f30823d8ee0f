"""What `LLM`'s methods take in vLLM's forms, checked and read: prompts (one or a list,
their `multi_modal_data`), `tokenization_kwargs`, `truncate_prompt_tokens`,
`lora_request`, the chat template's content format, and whether the tokenizer spaces
special tokens apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve.chat.rendering import chat_images
from serve.engine.detokenizer import text_decoder
from serve.engine.image_inputs import ImageInputs
from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.sampling_params import check_truncate_prompt_tokens

# A prompt: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]} dict.
Prompt = str | list[int] | dict[str, Any]
# vLLM's `tokenization_kwargs` that serve honours; any other is refused by name.
TOKENIZATION_KWARGS = ("truncate_prompt_tokens", "add_special_tokens")
# vLLM's `chat_template_content_format`s that are what serve renders: a message's content
# as text (its text parts joined). "openai" (the parts themselves) is not.


def truncated_prompt(
    token_ids: list[int],
    keep: int | None,
    max_model_len: int,
    is_prefill_only: bool,
    is_pooling: bool = False,
) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens, or for an
    embedding its first (vLLM's pooling runner truncates on the right); -1: as many as the
    context holds with room for one output token (all of it for a prefill-only request),
    as vLLM counts it. None: the prompt as it is."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len if is_prefill_only else max(max_model_len - 1, 1)
    elif keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens is {keep}, more than the context holds "
            f"(max_model_len {max_model_len})."
        )
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if is_pooling else token_ids[-keep:]


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, a dict) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]
    return list(prompts)


def prompt_images(prompt: Prompt) -> list[Any]:
    """vLLM's `multi_modal_data` of a prompt dict, `{"image": an image or a list of them}`,
    as the list of its images ([] for a prompt without)."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(
            f'multi_modal_data is a dict such as {{"image": image}}; got {type(data).__name__}.'
        )
    others = sorted(set(data) - {"image"})
    if others:
        raise ValueError(f"multi_modal_data takes images alone ('image'); serve reads no {others}.")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def with_images(
    images: ImageInputs, prompt: Prompt, token_ids: list[int], keep: int | None
) -> tuple[list[int], tuple[MultiModalInput, ...]]:
    """A prompt's token ids with its `multi_modal_data` images' placeholders widened, and
    the images as the engine takes them (`ImageInputs.process`: the placeholders and the
    images must pair up). `keep`, a truncation, cannot apply to a prompt with images."""
    given = prompt_images(prompt)
    images.check_count(len(given))
    kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs is a dict; got {type(kwargs).__name__}.")
    loaded = [images.load(image) for image in given]
    token_ids, mm_inputs = images.process(token_ids, loaded, kwargs)
    check_untruncated(mm_inputs, keep)
    return token_ids, mm_inputs


def check_untruncated(mm_inputs: tuple[MultiModalInput, ...], keep: int | None) -> None:
    """A truncation (`keep`, its last tokens) cannot apply to a prompt with images."""
    if mm_inputs and keep is not None:
        raise ValueError(
            "truncate_prompt_tokens cannot cut a prompt with images (an image's tokens would "
            "be cut apart); leave it unset for such prompts."
        )


def conversation_images(images: ImageInputs, conversation: list[dict[str, Any]]) -> list[Any]:
    """A chat's images (its `image_url` parts read, its `image_pil` parts as given), in
    the order of their placeholders, once the model and the limit take that many."""
    sources = chat_images(conversation)
    images.check_count(len(sources))
    return [images.load(source) for source in sources]


def lora_list(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """vLLM's `lora_request`: one LoRARequest (or None) for every prompt, or one per prompt."""
    if not isinstance(lora_request, (list, tuple)):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ValueError(
            f"Got {len(lora_request)} lora_requests for {num_prompts} prompts; give one for "
            "all or one per prompt."
        )
    return list(lora_request)


def tokenization_options(kwargs: dict[str, Any] | None) -> tuple[int | None, bool | None]:
    """vLLM's `tokenization_kwargs` that serve honours: `truncate_prompt_tokens` (the
    prompt's last N tokens; -1: the context's worth) and `add_special_tokens`."""
    options = dict(kwargs or {})
    keep = options.pop("truncate_prompt_tokens", None)
    add_special_tokens = options.pop("add_special_tokens", None)
    if options:
        raise ValueError(
            f"tokenization_kwargs takes {' and '.join(TOKENIZATION_KWARGS)} here; serve has no "
            f"setting for {', '.join(sorted(options))}."
        )
    check_truncate_prompt_tokens(keep)
    if add_special_tokens is not None and not isinstance(add_special_tokens, bool):
        raise ValueError(f"add_special_tokens must be true or false, got {add_special_tokens!r}.")
    return keep, add_special_tokens


def spaces_between_special_tokens(tokenizer: Any) -> bool:
    """Whether decoding puts spaces between adjacent special (added) tokens: two of them
    decode to more than their texts joined (WordPiece does; byte-level BPE does not)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if not added:
        return False
    (first_id, first), (last_id, last) = next(iter(added.items())), list(added.items())[-1]
    text = text_decoder(tokenizer)([first_id, last_id], False)
    return text != f"{first.content}{last.content}"
