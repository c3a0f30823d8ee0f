"""Per-request decoding controls, validated when constructed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from serve.pooling_params import PoolingParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
# A bad word is a word or a phrase. The engine tokenizes them as the request arrives, in its
# step loop: megabytes of them stalled every running stream for seconds.
MAX_BAD_WORD_CHARS = 1000


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar; exactly one of the constraints is set.

    `json`: a JSON schema (dict or its text); `json_object`: any JSON object; `regex`;
    `choice`: one of these strings, verbatim; `grammar`: EBNF in xgrammar's (GBNF-like)
    dialect, with a `root` rule. A schema that uses a keyword the grammar engine would
    ignore is refused (`unenforceable_json_schema`).

    vLLM's options are accepted as they hold here: JSON is always laid out as json.dumps
    writes it on one line, with no other whitespace (`disable_any_whitespace` true, which
    is also what false gets), and an object holds only the properties its schema allows
    (`disable_additional_properties` true; false gets the same). vLLM's `structural_tag`
    and `whitespace_pattern` are refused: serve cannot constrain to them.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise ValueError("choice must be a non-empty list of strings.")
        kinds = [k for k in _CONSTRAINTS if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured output takes exactly one of json, json_object, regex, choice or "
                f"grammar; got {kinds or 'none'}."
            )
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} {REFUSED_OPTIONS[name]}")
        problem = unenforceable_json_schema(self.json) if self.json is not None else None
        if problem is not None:
            raise ValueError(problem)

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        )


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "structural_tag")  # and json_object
# vLLM's fields that serve cannot honour, and why.
REFUSED_OPTIONS = {
    "structural_tag": "is not supported by this server: constrain the output with json, "
    "json_object, regex, choice or grammar, or its tool calls with tool_choice.",
    "whitespace_pattern": "is not supported by this server: JSON is written as json.dumps "
    'lays it out on one line (", " and ": "), with no other whitespace.',
}

# ---- JSON schema keywords the grammar engine would ignore ----
#
# xgrammar 0.2.8 compiles these without enforcing them: output that breaks them parses and
# ends with finish_reason "stop". A schema using one is refused rather than broken quietly.
# tests/worker/test_structured_output.py shows xgrammar ignoring each, and enforcing what
# is let through (multipleOf on integers, a length or a pattern alone, a type list).

_IGNORED_KEYWORDS = "not if dependentRequired dependentSchemas dependencies contains".split()
# Read only under a `type`, or the object or array type xgrammar infers from the keywords
# in _INFERRED_TYPES.
_TYPED_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "array": ("minItems", "maxItems"),
    "object": ("minProperties", "maxProperties", "patternProperties", "propertyNames"),
}
_INFERRED_TYPES = {
    "object": {"properties", "additionalProperties"},
    "array": {"items", "prefixItems"},
}
# Beside anyOf, oneOf, allOf or $ref, xgrammar reads the combinator alone: these are lost.
_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
_ASSERTIONS = {keyword for keywords in _TYPED_KEYWORDS.values() for keyword in keywords} | set(
    "properties additionalProperties items prefixItems required enum const format multipleOf "
    "uniqueItems unevaluatedProperties unevaluatedItems minContains maxContains".split()
)
# Where subschemas sit: maps of them, lists of them, one of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")


def unenforceable_json_schema(schema: dict[str, Any] | str) -> str | None:
    """Why serve cannot hold output to `schema` (a dict, or its text): the first keyword
    the grammar engine would ignore, with where it is (a JSON pointer); None if there is
    none. Text that is not JSON is left for the grammar compiler to report."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None
    for pointer, subschema, is_property_name in _subschemas(schema, "", False):
        found = _ignored_keyword(subschema, is_property_name)
        if found is not None:
            what, hint = found
            where = f"at {pointer}" if pointer else "at the schema's root"
            return (
                f"The JSON schema's {what} {where} is not supported: xgrammar, which "
                f"constrains the output, does not enforce it, so the output could break the "
                f"schema.{' ' + hint if hint else ''}"
            )
    return None


def _subschemas(schema: Any, pointer: str, is_property_name: bool) -> Iterator[tuple]:
    """(JSON pointer, subschema, whether it describes property names), parents first."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema, is_property_name
    for key, value in schema.items():
        here = f"{pointer}/{_escaped(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, subschema in value.items():
                yield from _subschemas(subschema, f"{here}/{_escaped(name)}", False)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, subschema in enumerate(value):
                yield from _subschemas(subschema, f"{here}/{i}", False)
        elif key in _SCHEMA_VALUES:
            yield from _subschemas(value, here, False)
        elif key == "propertyNames":
            yield from _subschemas(value, here, True)


def _escaped(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")  # RFC 6901


def _ignored_keyword(schema: dict[str, Any], is_property_name: bool) -> tuple[str, str] | None:
    """(the keyword, in words; a hint) for the first keyword of this one schema that the
    grammar would ignore, or None. Its subschemas are checked on their own."""
    types = _types(schema) or ({"string"} if is_property_name else set())
    branches = schema.get("allOf")
    if isinstance(branches, list) and len(branches) > 1:
        return f"`allOf` of {len(branches)} schemas", "Merge them into one schema."
    combinator = next((k for k in _COMBINATORS if k in schema), None)
    if combinator is not None:
        lost = [k for k in schema if k in _ASSERTIONS]
        if "type" in schema and not _branches_within(schema, combinator, types):
            lost.insert(0, "type")
        if lost:
            target = "the schema it names" if combinator == "$ref" else f"each {combinator} schema"
            return f"`{lost[0]}` beside `{combinator}`", f"Move it into {target}."
    keyword = next((k for k in _IGNORED_KEYWORDS if k in schema), None)
    if keyword is not None:
        return f"`{keyword}`", ""
    if schema.get("uniqueItems") is True:
        return "`uniqueItems`", ""
    multiple = schema.get("multipleOf")
    whole = isinstance(multiple, int) or (isinstance(multiple, float) and multiple.is_integer())
    if multiple is not None and (not types or "number" in types or not whole):
        return "`multipleOf`", 'It is enforced as a whole number under "type": "integer".'
    bound = next((k for k in ("minLength", "maxLength") if k in schema), None)
    shape = next((k for k in ("pattern", "format") if k in schema), None)
    if bound and shape and (not types or "string" in types):
        hint = "Write the length into the pattern (e.g. {1,20})." if shape == "pattern" else ""
        return f"`{bound}` beside `{shape}`", hint
    required = schema.get("required")
    if isinstance(required, list) and (not types or "object" in types):
        properties = schema.get("properties")
        undefined = [n for n in required if not isinstance(properties, dict) or n not in properties]
        if undefined:
            return (
                f"`required` {undefined[0]!r}, which is not in `properties`,",
                "Define it under properties: no other property is written.",
            )
    if "propertyNames" in schema and "properties" in schema:
        return "`propertyNames` beside `properties`", ""
    if not types and not any(k in schema for k in ("enum", "const")):
        inferred = next((t for t, hints in _INFERRED_TYPES.items() if hints & schema.keys()), "")
        for kind, keywords in _TYPED_KEYWORDS.items():
            keyword = next((k for k in keywords if k in schema and kind != inferred), None)
            if keyword is not None:
                return f"`{keyword}` in a schema without `type`", f'Add "type": "{kind}".'
    return None


def _types(schema: dict[str, Any]) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    return {t for t in declared if isinstance(t, str)} if isinstance(declared, list) else set()


def _branches_within(schema: dict[str, Any], combinator: str, types: set[str]) -> bool:
    """A `type` beside a combinator is lost, which is harmless where each branch has a type
    within it (or is a $ref, an enum or a const: typed where they are written)."""
    if combinator == "$ref":
        return True
    return all(
        isinstance(branch, dict)
        and (
            any(k in branch for k in ("$ref", "enum", "const"))
            or bool(_types(branch) and _types(branch) <= types)
        )
        for branch in schema.get(combinator) or []
    )


@dataclass
class SamplingParams:
    """How to decode one request, mirroring vLLM's `SamplingParams`.

    `best_of` sequences are sampled from one computation of the prompt (their KV blocks
    shared until they diverge) and the `n` with the highest cumulative logprob returned;
    with a `seed`, sample i draws from its own stream seeded `seed + i`. With
    `use_beam_search`, `best_of` is the beam width and `n` of the best beams are returned,
    ranked as HF transformers ranks them (`length_penalty`, `early_stopping`).
    `max_tokens=None` means "until the context window is full". `max_tokens=0` makes a
    prefill-only request: its prompt is computed (for `prompt_logprobs`, or pooled into an
    embedding with `pooling`), no token is sampled, and it ends in the step that computes
    its last prompt token.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in HF transformers
    # Penalties, as OpenAI and vLLM define them: presence and frequency over the output so
    # far, repetition (HF's, divides positive logits) over prompt and output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many are generated
    bad_words: list[str] | None = None  # never generated (their tokenisations are masked)
    allowed_token_ids: list[int] | None = None  # only these may be generated
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token but the first
    structured_outputs: StructuredOutputsParams | None = None
    # Pool the prompt's hidden states into one vector (pooling_params.py); max_tokens 0.
    pooling: PoolingParams | None = None
    _stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    # Each bad word's token ids, with and without a leading space (update_from_tokenizer).
    _bad_words_token_ids: list[list[int]] = field(
        init=False, repr=False, compare=False, default_factory=list
    )
    # A beam search of width 1, run as greedy search: it still reports its score (the
    # cumulative logprob), as every beam search does.
    _is_one_beam: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}.")
        if self.best_of is None:
            self.best_of = self.n
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}.")
        for name in ("top_k", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}.")
        if self.is_prefill_only and (self.best_of != 1 or self.use_beam_search):
            raise ValueError(
                "max_tokens is 0: the prompt alone is computed and nothing sampled, so n and "
                "best_of must be 1 and use_beam_search off."
            )
        if self.pooling is not None and not self.is_prefill_only:
            raise ValueError(
                f"max_tokens must be 0 for a pooling request (it samples nothing), got "
                f"{self.max_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}.")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}.")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}."
            )
        self._stop_strings = tuple(stops)
        self._check_decoding_controls()
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}."
            )
        if self.use_beam_search:
            self._check_beam_search()
            if self.best_of == 1:
                # One beam is greedy search, as HF transformers runs `num_beams=1`; a true
                # one-beam search would keep going past an EOS that greedy stops at.
                self.use_beam_search = False
                self._is_one_beam = True
        elif self.is_greedy:
            # Greedy ignores the filters; normalising keeps the sampler's fast path simple.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_decoding_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            for token, bias in self.logit_bias.items():
                if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise ValueError(
                        f"logit_bias maps token ids (>= 0) to values in [-100, 100]; "
                        f"got {token}: {bias}."
                    )
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r:.200}.")
        if self.bad_words is not None and any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise ValueError(
                f"bad_words are words or phrases of at most {MAX_BAD_WORD_CHARS} characters "
                f"each; got one of {max(len(w) for w in self.bad_words)}."
            )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(
                "allowed_token_ids must be a non-empty list of non-negative integers, "
                f"got {self.allowed_token_ids!r:.200}."
            )
        if self.allowed_token_ids is not None:
            # Once each: the sampler builds the row's mask from the list every step.
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}.")

    def token_ids_to_check(self) -> list[int]:
        """The token ids this request names (stop, bias, allowed), for the engine to check
        against the vocabulary."""
        return [
            *self.stop_token_ids,
            *(self.logit_bias or {}),
            *(self.allowed_token_ids or []),
        ]

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words`; the engine calls this when a request arrives. A word is
        banned in both the forms it takes in a text: at its start and after a space.
        Idempotent, so one params object may serve many requests."""
        if not self.bad_words or self._bad_words_token_ids:
            return
        token_ids: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in token_ids:
                    token_ids.append(ids)
        self._bad_words_token_ids = token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token-id sequences the sampler bans (see `update_from_tokenizer`)."""
        if self.bad_words and not self._bad_words_token_ids:
            raise RuntimeError("bad_words are not tokenized: call update_from_tokenizer first.")
        return self._bad_words_token_ids

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def _check_beam_search(self) -> None:
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}."
            )
        if self.temperature != 0.0:
            raise ValueError(
                f"temperature must be 0 with beam search, which is deterministic; "
                f"got {self.temperature}."
            )
        if self.top_p != 1.0 or self.top_k or self.min_p:
            raise ValueError(
                "top_p, top_k and min_p do not apply to beam search: leave them unset."
            )
        if self._stop_strings:
            raise ValueError(
                "stop strings are not supported with beam search, which stops only at EOS, "
                "stop_token_ids or max_tokens."
            )
        if self.structured_outputs is not None:
            raise ValueError(
                "structured_outputs (response_format, guided_*) cannot be combined with beam "
                "search; sample instead."
            )
        controls = [
            name
            for name, unset in (
                ("presence_penalty", 0.0),
                ("frequency_penalty", 0.0),
                ("repetition_penalty", 1.0),
                ("logit_bias", None),
                ("min_tokens", 0),
                ("bad_words", None),
                ("allowed_token_ids", None),
            )
            if getattr(self, name) != unset
        ]
        if controls:
            raise ValueError(
                f"{controls[0]} does not apply to beam search, which ranks beams by the "
                "model's own logprobs; leave it unset or sample instead."
            )

    def beam_stop_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """The tokens that end a beam: stop_token_ids, and EOS unless ignore_eos."""
        stop_ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            stop_ids |= set(eos_token_ids)
        return stop_ids

    def num_beam_candidates(self, eos_token_ids: Iterable[int]) -> int:
        """Candidates a beam search step ranks over all beams, as HF transformers does:
        enough to fill the beams even if every stop token ranks among them. Each beam's
        best that many next tokens are all the step can pick from that beam."""
        return max(2, 1 + len(self.beam_stop_token_ids(eos_token_ids))) * (self.best_of or 1)

    @property
    def needs_logprobs(self) -> bool:
        """Whether each output token's logprob is computed and reported: the request
        asked for them (`logprobs`, 0 included), or its outputs are ranked by their sum
        (`best_of` > n; beam search, whose scores come from its own log-softmax, and
        whose width 1 runs as greedy search). Otherwise none is, and its outputs'
        `cumulative_logprob` is None, as in vLLM."""
        return (
            self.logprobs is not None
            or self.use_beam_search
            or self._is_one_beam
            or (self.best_of or self.n) > self.n
        )

    @property
    def is_prefill_only(self) -> bool:
        """Nothing is sampled: the request ends once its prompt is computed."""
        return self.max_tokens == 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_strings
