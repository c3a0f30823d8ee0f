"""Incremental detokenization and stop strings (the front end's), with real (offline-built)
tokenizers.

Two decoders: the tiny byte-level BPE (GPT-2 / SmolLM2 style, where a token may carry half
a UTF-8 character) and a sentencepiece-style BPE with `<0xNN>` byte-fallback tokens (Llama
2 / Mistral style, where the decoder strips the text's leading space and decodes each run
of byte tokens as a whole).
"""

from __future__ import annotations

import json
import random

import pytest
import transformers
from tiny_models import build_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from serve.engine.detokenizer import (
    IncrementalDetokenizer,
    find_stop_string,
    text_decoder,
    token_text_in_context,
)

MULTIBYTE_TEXT = "héllo wörld — 你好 🙂"
TEXTS = [
    "Hello, world! How are you today?",
    MULTIBYTE_TEXT,
    "你好🙂🙂你好 the end",  # runs of multi-byte characters with no space between
    "The capital of France is Paris. ✓ naïve café — ½ ∞ 🙂🙃",
]

_SP_CORPUS = """The quick brown fox jumps over the lazy dog. Hello world, how are you today?
Paged attention stores keys and values in blocks. The sea is wide and blue."""


@pytest.fixture(scope="module")
def byte_level():
    return build_tokenizer()


@pytest.fixture(scope="module")
def byte_fallback():
    """A sentencepiece-style BPE: `▁` for spaces, `<0xNN>` for anything not in its ASCII
    vocab, and the Llama 2 decoder chain (Replace, ByteFallback, Fuse, Strip)."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    bpe.train_from_iterator([_SP_CORPUS] * 4, trainer=trainer)
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


class Decoded:
    """A sequence's text as the output processor builds it, one token at a time."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.output_ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.output_ids.append(token_id)
        delta = self.detokenizer.update(self.output_ids)
        self.text += delta
        return delta


def detokenize(tokenizer, prompt_ids: list[int], output_ids: list[int], **kwargs):
    """Feed `output_ids` one at a time, as the front end does; returns (decoded, deltas)."""
    decoded = Decoded(tokenizer, prompt_ids, **kwargs)
    deltas = [decoded.push(token_id) for token_id in output_ids]
    return decoded, deltas


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- byte-level BPE -------------------------------------------------------------------------------


def test_multibyte_characters_are_split_across_tokens(byte_level):
    ids = encode(byte_level, MULTIBYTE_TEXT)
    alone = [byte_level.decode([i]) for i in ids]
    assert any("\ufffd" in text for text in alone)  # the test below needs partial characters
    assert byte_level.decode(ids) == MULTIBYTE_TEXT


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_decode_byte_level(byte_level, text):
    prompt = encode(
        byte_level, "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
    )
    output = encode(byte_level, text)
    seq, deltas = detokenize(byte_level, prompt, output)
    assert seq.text == byte_level.decode(output, skip_special_tokens=True) == text
    assert not any("\ufffd" in delta for delta in deltas)  # partial characters are held back
    assert seq.detokenizer.prefix_offset > len(prompt)  # the window follows the output


@pytest.mark.parametrize("text", TEXTS)
def test_every_prompt_output_split_byte_level(byte_level, text):
    ids = encode(byte_level, "Answer: " + text)
    for split in range(1, len(ids)):
        prompt_text = byte_level.decode(ids[:split])
        if prompt_text.endswith("\ufffd"):
            continue  # a prompt cut inside a character has no well-defined continuation
        seq, _ = detokenize(byte_level, ids[:split], ids[split:])
        assert prompt_text + seq.text == "Answer: " + text, split


def test_random_token_sequences_byte_level(byte_level):
    """Random ids (special tokens and stray UTF-8 bytes included): the text equals HF's
    decode, except that a trailing incomplete character is still held back."""
    rng = random.Random(0)
    vocab_size = len(byte_level)
    num_held = 0
    for _ in range(300):
        prompt = encode(byte_level, rng.choice(TEXTS))
        output = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 16))]
        seq, _ = detokenize(byte_level, prompt, output)
        expected = byte_level.decode(output, skip_special_tokens=True)
        if seq.text != expected:
            assert expected.startswith(seq.text) and expected.endswith("\ufffd")
            num_held += 1
    assert num_held < 150


def test_special_tokens_skipped_or_kept(byte_level):
    prompt = encode(byte_level, "Hi")
    output = encode(byte_level, "Hello") + byte_level.convert_tokens_to_ids(["<|im_end|>"])
    output += encode(byte_level, " world") + [byte_level.eos_token_id]
    seq, deltas = detokenize(byte_level, prompt, output)
    assert seq.text == "Hello world"
    assert deltas[-1] == ""
    seq, _ = detokenize(byte_level, prompt, output, skip_special_tokens=False)
    assert seq.text == byte_level.decode(output) == "Hello<|im_end|> world<|endoftext|>"


def test_output_of_only_special_tokens_is_empty(byte_level):
    seq, deltas = detokenize(byte_level, encode(byte_level, "Hi"), [byte_level.eos_token_id] * 3)
    assert seq.text == "" and deltas == ["", "", ""]


# -- byte-fallback (sentencepiece-style) BPE ------------------------------------------------------


def test_byte_fallback_tokenizer_splits_characters_into_byte_tokens(byte_fallback):
    ids = encode(byte_fallback, MULTIBYTE_TEXT)
    tokens = byte_fallback.convert_ids_to_tokens(ids)
    assert "<0xF0>" in tokens and "<0xE4>" in tokens  # 🙂 and 你 as bytes
    assert byte_fallback.decode(ids) == MULTIBYTE_TEXT


@pytest.mark.parametrize("text", TEXTS)
def test_every_prompt_output_split_byte_fallback(byte_fallback, text):
    """The output is the prompt's continuation: its leading space is kept (where decoding
    the output alone would strip it), and characters whose byte tokens straddle the split
    come out whole."""
    ids = encode(byte_fallback, text)
    full_text = byte_fallback.decode(ids)
    assert full_text == text
    for split in range(1, len(ids)):
        prompt_text = byte_fallback.decode(ids[:split])
        if prompt_text.endswith("\ufffd"):
            continue
        seq, _ = detokenize(byte_fallback, ids[:split], ids[split:])
        assert prompt_text + seq.text == full_text, split


def test_byte_fallback_output_after_a_run_of_byte_tokens(byte_fallback):
    """Regression: the prompt ends in a run of byte tokens longer than the initial context
    window, so the window used to open inside 你 and ByteFallback replaced the whole run,
    the output's 🙂 included, with U+FFFD."""
    prompt = encode(byte_fallback, "Hello 你好")
    output = encode(byte_fallback, "Hello 你好🙂 world")[len(prompt) :]
    assert byte_fallback.convert_ids_to_tokens(output)[0] == "<0xF0>"
    seq, _ = detokenize(byte_fallback, prompt, output)
    assert seq.text == "🙂 world"


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
@pytest.mark.parametrize("text", [*TEXTS, "Hello world 日本 the sea 🎉 x"])
def test_token_labels_in_context_join_to_the_text(request, name, text):
    """Each token labelled after the ones before it (logprobs' labels, as vLLM's): the
    pieces of a split character "" and then the whole character, a sentencepiece token
    with the space it writes after a neighbour; together, the decoded text."""
    tokenizer = request.getfixturevalue(name)
    ids = encode(tokenizer, text)
    decode = text_decoder(tokenizer)
    labels = [token_text_in_context(decode, t, ids[max(0, i - 4) : i]) for i, t in enumerate(ids)]
    assert "\ufffd" not in "".join(labels) or "\ufffd" in text
    assert "".join(labels) == tokenizer.decode(ids)


# -- stop strings ----------------------------------------------------------------------------


class StopText:
    """Text growing by decoded pieces, checked for stop strings as the front end does."""

    def __init__(self, stop, include: bool = False):
        self.stops = [stop] if isinstance(stop, str) else list(stop)
        self.include = include
        self.text = ""
        self.stop_reason = None

    def push(self, new_text: str) -> bool:
        self.text += new_text
        found = find_stop_string(self.text, len(new_text), self.stops, self.include)
        if found is None:
            return False
        keep, self.stop_reason = found
        self.text = self.text[:keep]
        return True


def test_stop_string_truncates_at_the_earliest_match():
    seq = StopText(["world", "lo", "xyz"])
    assert seq.push("hello world")
    assert seq.text == "hel"
    assert seq.stop_reason == "lo"


def test_of_two_stops_completed_at_once_the_one_ending_first_wins():
    """As text growing a character at a time would meet them (vLLM's rule): "n" ends
    inside " into" before it does."""
    seq = StopText([" into", "n"])
    assert seq.push("yle into")
    assert (seq.text, seq.stop_reason) == ("yle i", "n")
    tie = StopText(["bc", "abc"])  # both end at the same character: the first listed
    assert tie.push("xabcx")
    assert (tie.text, tie.stop_reason) == ("xa", "bc")


def test_stop_string_split_across_two_updates():
    seq = StopText("STOP")
    assert not seq.push("foo ST")
    assert seq.text == "foo ST" and seq.stop_reason is None
    assert seq.push("OP bar")
    assert seq.text == "foo "
    assert seq.stop_reason == "STOP"


def test_stop_string_split_across_many_one_char_updates():
    seq = StopText(["abcd"])
    for i, char in enumerate("xxabcdyy"):
        found = seq.push(char)
        assert found == (i == 5)
        if found:
            break
    assert seq.text == "xx" and seq.stop_reason == "abcd"


def test_include_stop_str_in_output_keeps_it():
    seq = StopText(["STOP"], include=True)
    assert not seq.push("foo ST")
    assert seq.push("OP bar")
    assert seq.text == "foo STOP"
    assert seq.stop_reason == "STOP"


def test_no_stop_strings_or_no_new_text():
    seq = StopText([])
    assert not seq.push("anything STOP")
    assert seq.stop_reason is None
    # Only text from this step can complete a stop.
    assert find_stop_string("STOP already here", 0, ["STOP"], False) is None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("tokenizer_name", ["byte_level", "byte_fallback"])
def test_stop_string_through_the_detokenizer(request, tokenizer_name, include):
    """Token by token, as the front end runs it; the stop strings span several tokens, and
    the multi-byte one is split inside its characters."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    prompt = encode(tokenizer, "Hi")
    output = encode(tokenizer, "The sea is wide — 你好🙂 and blue, the sky is high.")
    # The output as the prompt's continuation (the byte-fallback one opens with a space).
    continuation = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :]
    for stop in [" wide", "你好🙂"]:
        decoded = Decoded(tokenizer, prompt)
        seq = StopText([stop], include)
        found = False
        for token_id in output:
            if seq.push(decoded.push(token_id)):
                found = True
                break
        assert found
        end = continuation.index(stop) + (len(stop) if include else 0)
        assert seq.text == continuation[:end]
        assert seq.stop_reason == stop


# -- which decode runs ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def word_piece():
    """A WordPiece tokenizer that cleans up spaces (BERT's "hello , world" -> "hello, world"):
    the Rust decode alone would keep the space."""
    vocab = {t: i for i, t in enumerate(["[UNK]", "[SEP]", "hello", "world", ",", "!", "'", "s"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_its_wrapper(word_piece):
    ids = encode(word_piece, "hello, world!")
    assert word_piece.backend_tokenizer.decode(ids) == "hello , world !"
    expected = word_piece.decode(ids)
    assert text_decoder(word_piece)(ids, True) == expected == "hello, world!"
    seq, _ = detokenize(word_piece, encode(word_piece, "hello"), ids)
    assert seq.text == " " + expected


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decode_gives_the_wrappers_text(byte_level, byte_fallback, skip):
    """Where the front end calls the Rust tokenizer directly, its text is transformers'."""
    rng = random.Random(1)
    for tokenizer in (byte_level, byte_fallback):
        assert text_decoder(tokenizer) is text_decoder(tokenizer)  # decided once
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
            expected = tokenizer.decode(ids, skip_special_tokens=skip)
            assert text_decoder(tokenizer)(ids, skip) == expected
