"""Per-request decoding controls, validated when constructed."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to decode one request, mirroring vLLM's `SamplingParams`.

    `best_of` sequences are sampled from one computation of the prompt (their KV blocks
    shared until they diverge) and the `n` with the highest cumulative logprob returned;
    with a `seed`, sample i draws from its own stream seeded `seed + i`. With
    `use_beam_search`, `best_of` is the beam width and `n` of the best beams are returned,
    ranked as HF transformers ranks them (`length_penalty`, `early_stopping`).
    `max_tokens=None` means "until the context window is full".
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
    _stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}.")
        if self.best_of is None:
            self.best_of = self.n
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}."
            )
        self._stop_strings = tuple(stops)
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
        elif self.is_greedy:
            # Greedy ignores the filters; normalising keeps the sampler's fast path simple.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_strings
