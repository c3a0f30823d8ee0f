"""Per-request decoding controls, validated when constructed."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from serve.outputs import OutputKind
from serve.pooling_params import PoolingParams
from serve.structured_outputs import (
    StructuredOutputsParams,  # also importable from here, as in vLLM
)

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
# A bad word is a word or a phrase. The engine tokenizes them as the request arrives, in its
# step loop: megabytes of them stalled every running stream for seconds.
MAX_BAD_WORD_CHARS = 1000

RequestOutputKind = OutputKind  # vLLM's name for it, importable from here as from vLLM


def check_truncate_prompt_tokens(keep: Any) -> None:
    """vLLM's `truncate_prompt_tokens` (on SamplingParams or in `tokenization_kwargs`):
    None, -1 (the context's worth) or a positive integer."""
    if keep is not None and (
        isinstance(keep, bool) or not isinstance(keep, int) or (keep < 1 and keep != -1)
    ):
        raise ValueError(
            f"truncate_prompt_tokens must be -1 (the context's worth) or a positive integer, "
            f"got {keep!r}."
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

    vLLM's output controls: `truncate_prompt_tokens=N` keeps the prompt's last N tokens
    (-1: as many as the context holds with room for one output token; the whole context
    for a prefill-only request), applied by `LLM` where it takes the prompt.
    `detokenize=False` leaves `LLM`'s output texts empty (token ids only; no stop strings
    then). `spaces_between_special_tokens` matters only where special tokens are kept in
    the text (`skip_special_tokens=False`); `LLM` refuses False with a tokenizer whose
    decoding puts spaces between them, which serve's detokenizer does not take out.
    `output_kind` is what `LLM.add_request`'s outputs carry each `step()`; `generate`
    returns finished outputs whatever it says, as vLLM's does. `seed=-1` is no seed.
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
    min_tokens: int = 0  # EOS (unless ignore_eos) and stop_token_ids masked until this many
    bad_words: list[str] | None = None  # never generated (their tokenisations are masked)
    allowed_token_ids: list[int] | None = None  # only these may be generated
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token but the first
    structured_outputs: StructuredOutputsParams | None = None
    # Pool the prompt's hidden states into one vector (pooling_params.py); max_tokens 0.
    pooling: PoolingParams | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE  # or vLLM's RequestOutputKind (by name)
    _stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    # Each bad word's token ids, with and without a leading space (update_from_tokenizer);
    # None until tokenized.
    _bad_words_token_ids: list[list[int]] | None = field(
        init=False, repr=False, compare=False, default=None
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
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None  # vLLM's spelling of "no seed"
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -(2**63) <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}.")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}."
            )
        self._stop_strings = tuple(stops)
        self._check_output_controls()
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

    def _check_output_controls(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        for name in ("detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        if self._stop_strings and not self.detokenize:
            raise ValueError(
                "stop strings are matched in the output's text: they need detokenize=True "
                "(or use stop_token_ids)."
            )
        self.output_kind = _output_kind(self.output_kind)

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

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's `clone` (a script's per-prompt variants of one base)."""
        return copy.deepcopy(self)

    def token_ids_to_check(self) -> list[int]:
        """The token ids this request names (stop, bias, allowed), for the engine to check
        against the vocabulary."""
        return [
            *self.stop_token_ids,
            *(self.logit_bias or {}),
            *(self.allowed_token_ids or []),
        ]

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        """Tokenize `bad_words`; the engine calls this when a request arrives, with its
        model's vocabulary size (the logits' width). A word is banned in both the forms it
        takes in a text: at its start and after a space. A form with a token past the
        model's vocabulary (a tokenizer larger than the model's embedding) can never be
        generated, so it is dropped: there is nothing to mask, and masking a token past the
        logits indexes out of bounds. Idempotent, so one params object may serve many
        requests."""
        if not self.bad_words:
            return
        if self._bad_words_token_ids is None:
            token_ids: list[list[int]] = []
            for word in self.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    ids = list(tokenizer.encode(text, add_special_tokens=False))
                    if ids and ids not in token_ids:
                        token_ids.append(ids)
            self._bad_words_token_ids = token_ids
        if vocab_size is not None:  # also for words tokenized before without it
            self._bad_words_token_ids = [
                ids for ids in self._bad_words_token_ids if max(ids) < vocab_size
            ]

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token-id sequences the sampler bans (see `update_from_tokenizer`)."""
        if self._bad_words_token_ids is None:
            if self.bad_words:
                raise RuntimeError("bad_words are not tokenized: call update_from_tokenizer first.")
            return []
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


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `LLM.beam_search(prompts, BeamSearchParams(...))` arguments. The beams are
    ranked as HF transformers ranks them (serve's beam search: `length_penalty` divides a
    beam's score by its output length to that power; `early_stopping` is HF's, serve's
    extra), not as vLLM's own search does; `beam_width` best are returned.

    What serve's search cannot honour is refused: a temperature (it ranks by the model's
    own logprobs, deterministically), `structured_outputs`, watermarking.
    `include_stop_str_in_output` is accepted: beam search has no stop strings."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    watermarking: bool | None = None
    early_stopping: bool | str = False  # True, False or "never", as in HF transformers

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.temperature != 0.0:
            raise ValueError(
                f"temperature must be 0: serve's beam search ranks beams by the model's own "
                f"logprobs, deterministically; got {self.temperature}."
            )
        if self.structured_outputs is not None:
            raise ValueError(
                "structured_outputs cannot be combined with serve's beam search; sample instead."
            )
        if self.watermarking:
            raise ValueError("watermarking is not supported by serve.")

    def sampling_params(self) -> SamplingParams:
        """The same search as serve's `SamplingParams(use_beam_search=True, ...)`, with every
        output token's candidates (`logprobs=0`: a beam's `logprobs`)."""
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=0,
        )


def _output_kind(kind: Any) -> OutputKind:
    """serve's `OutputKind`, from itself, vLLM's `RequestOutputKind` (its member, by name,
    or its number: 0 cumulative, 1 delta, 2 final only) or its name."""
    if isinstance(kind, OutputKind):
        return kind
    name = getattr(kind, "name", kind)
    if isinstance(name, str) and name.upper() in OutputKind.__members__:
        return OutputKind[name.upper()]
    numbered = (OutputKind.CUMULATIVE, OutputKind.DELTA, OutputKind.FINAL_ONLY)
    if type(kind) is int and 0 <= kind < len(numbered):
        return numbered[kind]
    raise ValueError(
        f"output_kind must be one of {', '.join(OutputKind.__members__)} (vLLM's "
        f"RequestOutputKind), got {kind!r}."
    )
