"""Structured output: grammars compiled by xgrammar, one matcher per sequence, logits masks.

Everything xgrammar lives here. Compiling runs in a background thread pool, cached by the
spec, so the API thread can submit a request's grammar and await the Future while the
engine thread keeps stepping; a compiled grammar travels as xgrammar's serialized JSON
(plain text, in the request's first step to the workers). The matchers and the bitmask
buffer belong to the driver worker's thread alone: it starts a matcher when it first sees
a constrained sequence (one whose grammar starts after a token, a reasoning model's end of
thinking, once that token is sampled: step_sampler.py), masks each step's logits, advances
the matcher with the sampled token and frees it when the sequence ends.

Choices made for every request:
- JSON schemas and `json_object` compile with `any_whitespace=False`: json.dumps's layout
  (`", "` and `": "`, no newlines), so a small model cannot loop on whitespace. vLLM's
  `disable_any_whitespace` asks for this; left false, it gets this too.
- Strict mode (xgrammar's default): an object holds only the properties its schema
  names, unless `additionalProperties` allows more (vLLM's `disable_additional_properties`).
  Schemas using keywords xgrammar would ignore never get here (StructuredOutputsParams
  refuses them, `unenforceable_json_schema`).
- `json_object` is the schema `{"type": "object"}`: any object, any keys and values.
- `choice` is an EBNF alternation of the strings as escaped literals.
After the structure is complete the grammar allows only the stop tokens (`eos_token_ids`).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from serve.sampling_params import StructuredOutputsParams

# Compiled grammars kept (least recently submitted dropped first), by count and by their
# serialized size all told. A nested JSON schema over a 49k vocabulary compiles to ~1 MB;
# a schema of hundreds of enum properties, 37 KB as text, to 133 MB, and takes seconds to
# load into a matcher: one past MAX_GRAMMAR_BYTES is refused (a 400).
MAX_CACHED_GRAMMARS = 128
MAX_CACHED_GRAMMAR_BYTES = 256 << 20
MAX_GRAMMAR_BYTES = 32 << 20
# Grammars loaded for matchers, kept for the next request of the same spec (loading a
# 1 MB one takes the engine thread milliseconds, every other stream waiting).
MAX_LOADED_GRAMMARS = 16

# xgrammar's C++ errors read "[19:07:34] /project/cpp/regex_converter.cc:83: <message>",
# some with "Check failed: (error.empty()) is false: " before the message.
_CPP_ERROR_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*(?:Check failed: .*? is false:\s*)?")

# A character of a length-bounded JSON string, as xgrammar 0.2.8 writes it and as it should.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"

_ERROR_NAMES = {
    "json": "Invalid JSON schema",
    "json_object": "Invalid JSON object grammar",
    "regex": "Invalid regex",
    "choice": "Invalid choice",
    "grammar": "Invalid grammar",
}

SpecKey = tuple[str, Any]  # (kind, canonical spec): hashable, equal for equal specs


class StructuredOutputManager:
    """Compiles structured-output specs and constrains each sequence's next token.

    `submit` may be called from any thread; every other method from the engine thread only.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_workers: int = 1,
    ) -> None:
        # vocab_size is the model's (the logits' width), which may exceed len(tokenizer):
        # xgrammar masks the ids with no token, as it masks special tokens.
        self.vocab_size = vocab_size
        self._tokenizer_info = _tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        # Our cache keys on the spec; xgrammar's own would hold a second copy of each.
        self._compiler = xgr.GrammarCompiler(
            self._tokenizer_info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
        )
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        # Guards _compiled, written by submit's callers and by finished compiles (reentrant:
        # a compile done already runs its callback inside submit).
        self._lock = threading.RLock()
        self._compiled: OrderedDict[SpecKey, Future] = OrderedDict()
        # Engine thread only.
        self._loaded: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()  # by serialized
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab_size / 32)] int32, CPU

    # ---- compiling (any thread) ----

    def submit(self, params: StructuredOutputsParams) -> Future[str]:
        """A Future of the compiled grammar for `params` (serialized: what `start` takes),
        compiled once per distinct spec.

        Concurrent submits of one spec share one Future. An invalid spec makes the Future
        raise ValueError; a failed compile is retried by the next submit of that spec.
        """
        try:
            key = _spec_key(params)
        except ValueError as e:
            failed: Future = Future()
            failed.set_exception(e)
            return failed
        with self._lock:
            future = self._compiled.get(key)
            if future is None or _has_failed(future):
                future = self._executor.submit(self._compile, key)
                self._compiled[key] = future
                future.add_done_callback(self._on_compiled)
            self._compiled.move_to_end(key)
            self._bound_compiled()
            return future

    def _on_compiled(self, _future: Future) -> None:
        """A compile finished (on the pool's thread): its size now counts."""
        with self._lock:
            self._bound_compiled()

    def _bound_compiled(self) -> None:
        """Under the lock. A compile still running counts as no bytes until it is done."""
        _drop_oldest(
            self._compiled,
            lambda _, future: _serialized_size(future),
            MAX_CACHED_GRAMMARS,
            MAX_CACHED_GRAMMAR_BYTES,
        )

    def _compile(self, key: SpecKey) -> str:
        kind, spec = key
        try:
            if kind in ("json", "json_object"):
                compiled = self._compiler.compile_grammar(json_schema_grammar(spec))
            elif kind == "regex":
                compiled = self._compiler.compile_regex(spec)
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(choice_grammar(spec))
            else:
                compiled = self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _CPP_ERROR_PREFIX.sub("", str(e)).strip()
            raise ValueError(f"{_ERROR_NAMES[kind]}: {message}") from None
        serialized = compiled.serialize_json()
        if len(serialized) > MAX_GRAMMAR_BYTES:
            raise ValueError(
                f"{_ERROR_NAMES[kind]}: it compiles to a grammar of "
                f"{len(serialized) / (1 << 20):.0f} MiB over this model's vocabulary, more "
                f"than serve takes ({MAX_GRAMMAR_BYTES >> 20} MiB). Simplify it: fewer "
                "properties or enum values, shorter alternatives."
            )
        return serialized

    # ---- matchers (engine thread) ----

    def start(self, seq_id: int, grammar: str) -> None:
        """Constrain `seq_id` from its next token on, at the start of `grammar` (as
        `submit` gives it, from this manager or another built from the same tokenizer)."""
        compiled = self._loaded.get(grammar)
        if compiled is None:
            compiled = xgr.CompiledGrammar.deserialize_json(grammar, self._tokenizer_info)
            self._loaded[grammar] = compiled
            _drop_oldest(
                self._loaded,
                lambda serialized, _: len(serialized),
                MAX_LOADED_GRAMMARS,
                MAX_CACHED_GRAMMAR_BYTES,
            )
        self._loaded.move_to_end(grammar)
        self._matchers[seq_id] = xgr.GrammarMatcher(compiled)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child continues from the parent's state; the two advance independently."""
        self._matchers[child_seq_id] = self._matchers[parent_seq_id].fork()

    def has(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance `seq_id`'s matcher by one token; False (state unchanged) if the grammar
        rejects it, which a token sampled from masked logits never is."""
        return self._matchers[seq_id].accept_token(token_id)

    def is_terminated(self, seq_id: int) -> bool:
        """The structure is complete and a stop token was accepted."""
        return self._matchers[seq_id].is_terminated()

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def mask_logits(self, logits: torch.Tensor, seq_ids: list[int]) -> None:
        """Set to -inf, in place, every token the grammar disallows next.

        logits: [len(seq_ids), vocab_size], row i for seq_ids[i]. Rows whose sequence has no
        matcher, or a terminated one, are left untouched.
        """
        if not self._matchers:
            return
        if logits.dim() != 2 or logits.shape != (len(seq_ids), self.vocab_size):
            raise ValueError(
                f"logits must be [{len(seq_ids)}, {self.vocab_size}] (one row per seq_id), "
                f"got {list(logits.shape)}."
            )
        bitmask = self._bitmask_rows(len(seq_ids))  # [len(seq_ids), ceil(vocab_size / 32)]
        rows = []
        for row, seq_id in enumerate(seq_ids):
            matcher = self._matchers.get(seq_id)
            if matcher is None or matcher.is_terminated():
                continue
            if matcher.fill_next_token_bitmask(bitmask, row):  # False: everything allowed
                rows.append(row)
        if not rows:
            return
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def mask_proposals(self, logits: torch.Tensor, checked: list[tuple[int, list[int]]]) -> None:
        """`mask_logits` for the rows of speculating sequences: `checked` lists (seq id,
        proposals), each with 1 + len(proposals) consecutive rows of `logits`; row j is
        masked as the grammar stands after proposals [0, j). The matcher takes the
        proposals to fill the rows, then rolls them back: the sampler decides which stay.
        Past a proposal the grammar refuses, rows are left as they are: that proposal is
        masked out, so it is rejected and no later row is read."""
        if not self._matchers:
            return
        bitmask = self._bitmask_rows(logits.shape[0])
        rows, offset = [], 0
        for seq_id, proposals in checked:
            matcher = self._matchers.get(seq_id)
            if matcher is not None:
                taken = 0
                for j in range(len(proposals) + 1):
                    if matcher.is_terminated():
                        break
                    if matcher.fill_next_token_bitmask(bitmask, offset + j):
                        rows.append(offset + j)
                    if j == len(proposals) or not matcher.accept_token(proposals[j]):
                        break
                    taken += 1
                if taken:
                    matcher.rollback(taken)
            offset += 1 + len(proposals)
        if rows:
            if bitmask.device != logits.device:
                bitmask = bitmask.to(logits.device)
            xgr.apply_token_bitmask_inplace(
                logits, bitmask[: logits.shape[0]], vocab_size=self.vocab_size, indices=rows
            )

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of the one CPU bitmask buffer, grown (doubled) as needed."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            capacity = max(num_rows, 2 * self._bitmask.shape[0] if self._bitmask is not None else 8)
            self._bitmask = xgr.allocate_token_bitmask(capacity, self.vocab_size)
        return self._bitmask[:num_rows]

    def shutdown(self) -> None:
        """Cancel pending compiles and drop every matcher and cached grammar."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._matchers.clear()
        with self._lock:
            self._compiled.clear()


def _tokenizer_info(
    tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the special tokens made unmatchable.

    xgrammar reads a byte-level vocabulary's special tokens (`<|im_start|>`,
    `<|endoftext|>`) as their literal text, so a JSON string could hold one; the
    detokenizer drops them, and the text returned would not be the text the grammar
    checked. A token with no text is one xgrammar never allows, except as a stop token.
    """
    stop_token_ids = sorted(set(eos_token_ids)) or None  # None: xgrammar guesses
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    added_tokens = getattr(tokenizer, "added_tokens_decoder", {})
    special_ids = set(tokenizer.all_special_ids)
    special_ids |= {token_id for token_id, token in added_tokens.items() if token.special}
    encoded_vocab = [""] * vocab_size  # as from_huggingface builds it, specials left empty
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special_ids:
            encoded_vocab[token_id] = token
    return xgr.TokenizerInfo(
        encoded_vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=detected.stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


def json_schema_grammar(schema: str) -> xgr.Grammar | str:
    """The grammar of `schema`'s instances as json.dumps lays them out on one line.

    xgrammar 0.2.8 compiles a string with minLength or maxLength to a repetition of a
    character class that admits raw control characters, which JSON forbids and strict
    parsers such as Python's json.loads reject (xgrammar issue #800). Such grammars get the
    class that xgrammar's unbounded strings use. Escapes stay unavailable in them.
    """
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR not in ebnf:
        return grammar
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def choice_grammar(choices: Iterable[str]) -> str:
    """xgrammar EBNF whose root is exactly one of `choices`."""
    return "root ::= " + " | ".join(_ebnf_literal(choice) for choice in choices)


def _ebnf_literal(text: str) -> str:
    """`text` as an xgrammar EBNF string literal: printable ASCII as is, everything else
    (quotes, backslashes, control and non-ASCII characters) escaped."""
    out = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _spec_key(params: StructuredOutputsParams) -> SpecKey:
    """The canonical cache key: a JSON schema as compact JSON text, whether given as a dict
    or as text in any layout. Keys are not sorted: xgrammar emits properties in the
    schema's order, which is the user's to choose (a "reasoning" field before "answer")."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            return kind, json.dumps(schema, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"Invalid JSON schema: {e}") from None
    if kind == "json_object":
        return kind, '{"type": "object"}'
    return kind, getattr(params, kind)


def _drop_oldest(
    cache: OrderedDict, size_of: Callable[[Any, Any], int], max_entries: int, max_bytes: int
) -> None:
    """Drop `cache`'s oldest entries (never its newest) while it holds more than
    `max_entries` or more than `max_bytes` by `size_of(key, value)`."""
    total = sum(size_of(key, value) for key, value in cache.items())
    while len(cache) > 1 and (len(cache) > max_entries or total > max_bytes):
        total -= size_of(*cache.popitem(last=False))


def _serialized_size(future: Future) -> int:
    if not future.done() or _has_failed(future):
        return 0
    return len(future.result())


def _has_failed(future: Future) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)
