"""Predicts how many tokens a request will generate, learned online from finished requests.

Shortest-job-first needs an output length before the job runs. Following S3 and µ-Serve,
lengths are classes (buckets on a log scale), learned from what this server has already
seen, with features it has without any extra forward pass:

- before the request runs: which tokens its prompt holds (hashed; instructions such as
  "answer in one word" and "write a long essay" differ in their tokens), the prompt's
  length and the output cap (`max_tokens`, or what the context leaves), classified by
  multinomial naive Bayes, which learns from a few dozen requests;
- once the prefill has run: the model's own final hidden state at the last prompt token
  (a fixed random projection of it), classified by a small logistic regression whose
  bucket probabilities combine with the first's as independent evidence. The scheduler uses this refined guess for
  requests already running (which to preempt first) and for any that must wait again.

A prediction is the expected length under a classifier's bucket probabilities, each
bucket standing for the mean length of the finished requests that fell in it, or for the
request's own output cap where that is less: a request cannot generate past it.

Fitting runs on a background thread every REFIT_EVERY finished requests, over the last
HISTORY of them; until MIN_SAMPLES requests have finished there is no model and
`predict` returns None (the scheduler then falls back to arrival order).

Writers: `observe` (the scheduler's thread) appends to the history under the lock; the
refit thread alone replaces `_models`, a tuple read whole by `predict`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

# Upper edges of the length classes: [0, 8), [8, 32), [32, 128), [128, 512), [512, 2048),
# [2048, ...): log-scaled, as output lengths spread over orders of magnitude.
BUCKET_EDGES = (8, 32, 128, 512, 2048)
NUM_BUCKETS = len(BUCKET_EDGES) + 1
TOKEN_HASH_DIMS = 1024  # prompt tokens hash into this many "words"
_LOG2_CLASSES = 32  # the prompt's length and the output cap, as classes of their log2
NUM_PROMPT_FEATURES = TOKEN_HASH_DIMS + 2 * _LOG2_CLASSES
HIDDEN_DIMS = 32  # the hidden state is projected to this many features
MIN_SAMPLES = 32
# Naive Bayes' additive smoothing, in counts: large enough that a token seen a few times in
# one class by chance weighs little beside one that comes with the class every time.
ADDITIVE_SMOOTHING = 5.0
REFIT_EVERY = 16
HISTORY = 2048
_HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash: spreads nearby token ids


def prompt_features(prompt_token_ids: Seq[int], max_output_tokens: int) -> np.ndarray:
    """What is known of a request before it runs, as the sorted indices of the "words" it
    holds: its tokens (hashed), its length class, its output cap's class."""
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    tokens = np.unique((ids * _HASH_MULTIPLIER) % TOKEN_HASH_DIMS)
    length_class = TOKEN_HASH_DIMS + min(_LOG2_CLASSES - 1, int(np.log2(len(ids) + 1)))
    cap_class = TOKEN_HASH_DIMS + _LOG2_CLASSES
    cap_class += min(_LOG2_CLASSES - 1, int(np.log2(max_output_tokens + 1)))
    return np.concatenate([tokens, [length_class, cap_class]]).astype(np.int64)


class HiddenProjection:
    """A fixed random projection of the model's hidden state to HIDDEN_DIMS features, unit
    length: the same for every request (seeded), so the classifier can learn on it."""

    def __init__(self, hidden_size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.matrix = rng.standard_normal((hidden_size, HIDDEN_DIMS)).astype(np.float32)

    def __call__(self, hidden_state: Seq[float]) -> np.ndarray:
        projected = np.asarray(hidden_state, dtype=np.float32) @ self.matrix
        return projected / (np.linalg.norm(projected) or 1.0)


def _bucket_values(lengths: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """The length each bucket stands for: the mean seen in it (its geometric middle if
    none was)."""
    lows = np.array((1,) + BUCKET_EDGES, dtype=np.float32)
    highs = np.array(BUCKET_EDGES + (BUCKET_EDGES[-1] * 4,), dtype=np.float32)
    values = np.sqrt(lows * highs)
    for b in range(NUM_BUCKETS):
        seen = lengths[buckets == b]
        if seen.size:
            values[b] = seen.mean()
    return values


@dataclass(frozen=True)
class _PromptClassifier:
    """Multinomial naive Bayes over the prompt's "words": learns from a few dozen requests
    which tokens go with which length class, where a linear model on a few thousand sparse
    features would fit the noise."""

    log_prior: np.ndarray  # [buckets]
    log_likelihood: np.ndarray  # [buckets, NUM_PROMPT_FEATURES]
    values: np.ndarray  # [buckets]

    def log_posteriors(self, prompts: list[np.ndarray]) -> np.ndarray:
        """Unnormalized: softmax them."""
        return np.stack([self.log_prior + self.log_likelihood[:, p].sum(axis=1) for p in prompts])

    def expected_lengths(self, prompts: list[np.ndarray]) -> np.ndarray:
        return _softmax(self.log_posteriors(prompts)) @ self.values


def fit_prompt_classifier(
    prompts: list[np.ndarray], lengths: np.ndarray, smoothing: float = ADDITIVE_SMOOTHING
) -> _PromptClassifier:
    buckets = np.searchsorted(BUCKET_EDGES, lengths, side="right")
    counts = np.full((NUM_BUCKETS, NUM_PROMPT_FEATURES), smoothing, dtype=np.float64)
    for words, b in zip(prompts, buckets):
        counts[b, words] += 1.0
    log_likelihood = np.log(counts / counts.sum(axis=1, keepdims=True))
    class_counts = np.bincount(buckets, minlength=NUM_BUCKETS).astype(np.float64)
    with np.errstate(divide="ignore"):  # a class never seen is never predicted
        log_prior = np.log(class_counts / class_counts.sum())
    return _PromptClassifier(log_prior, log_likelihood, _bucket_values(lengths, buckets))


@dataclass(frozen=True)
class _HiddenClassifier:
    """Multinomial logistic regression on the projected hidden state. Its bucket
    probabilities combine with the prompt classifier's as independent evidence:
    p(b | prompt, hidden) ∝ p(b | prompt) · p(b | hidden) / p(b)."""

    weights: np.ndarray  # [1 + HIDDEN_DIMS, buckets]
    log_prior: np.ndarray  # [buckets]

    def log_ratios(self, hiddens: list[np.ndarray]) -> np.ndarray:
        logits = _with_bias(hiddens) @ self.weights
        return np.log(_softmax(logits) + 1e-12) - self.log_prior


def fit_hidden_classifier(
    hiddens: list[np.ndarray], lengths: np.ndarray, steps: int = 300, l2: float = 1e-3
) -> _HiddenClassifier:
    """Full-batch Adam: a few thousand samples of a few dozen features, milliseconds."""
    features = _with_bias(hiddens)
    n, dims = features.shape
    buckets = np.searchsorted(BUCKET_EDGES, lengths, side="right")
    targets = np.zeros((n, NUM_BUCKETS), dtype=np.float32)
    targets[np.arange(n), buckets] = 1.0
    weights = np.zeros((dims, NUM_BUCKETS), dtype=np.float32)
    mean, var = np.zeros_like(weights), np.zeros_like(weights)
    rate, beta1, beta2 = 0.05, 0.9, 0.999
    for t in range(1, steps + 1):
        grad = features.T @ (_softmax(features @ weights) - targets) / n + l2 * weights
        mean = beta1 * mean + (1 - beta1) * grad
        var = beta2 * var + (1 - beta2) * grad * grad
        step = rate * np.sqrt(1 - beta2**t) / (1 - beta1**t)
        weights -= step * mean / (np.sqrt(var) + 1e-8)
    class_counts = targets.sum(axis=0) + 1.0
    return _HiddenClassifier(weights, np.log(class_counts / class_counts.sum()))


def _with_bias(hiddens: list[np.ndarray]) -> np.ndarray:
    ones = np.ones((len(hiddens), 1), dtype=np.float32)
    return np.concatenate([ones, np.stack(hiddens)], axis=1)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class _Sample:
    prompt: np.ndarray
    hidden: np.ndarray | None
    length: int


class OutputLengthPredictor:
    """Learns output lengths from finished requests; predicts them for new ones.

    `background=False` fits on the caller's thread (tests, and deterministic runs)."""

    def __init__(self, background: bool = True) -> None:
        self._history: deque[_Sample] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._since_fit = 0
        # (prompt-only classifier, classifier with hidden features or None), or None.
        self._models: tuple[_PromptClassifier, _HiddenClassifier | None] | None = None
        self.version = 0  # bumped by each refit: predictions made earlier are stale
        self._errors: deque[float] = deque(maxlen=256)
        self._background = background
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._refit_loop, name="sjf-refit", daemon=True)
            self._thread.start()

    @property
    def is_active(self) -> bool:
        return self._models is not None

    @property
    def mean_absolute_error(self) -> float | None:
        """Tokens between the prediction made for a request when it was admitted and what it
        generated, over the last 256 predicted requests; None before any."""
        errors = list(self._errors)
        return float(np.mean(errors)) if errors else None

    def predict(
        self, prompt: np.ndarray, hidden: np.ndarray | None = None, cap: float = np.inf
    ) -> float | None:
        """Expected output tokens, at most `cap` (None while cold)."""
        return self.predict_many([prompt], [hidden], [cap])[0]

    def predict_many(
        self,
        prompts: list[np.ndarray],
        hiddens: list[np.ndarray | None],
        caps: list[float] | None = None,
    ) -> list[float | None]:
        """`caps`: each request's most output tokens; a bucket's length counts up to it."""
        models = self._models
        if models is None:
            return [None] * len(prompts)
        base, refined = models
        scores = base.log_posteriors(prompts)
        rows = [i for i, h in enumerate(hiddens) if h is not None]
        if refined is not None and rows:
            scores[rows] += refined.log_ratios([hiddens[i] for i in rows])
        limits = np.asarray(caps if caps is not None else [np.inf] * len(prompts))[:, None]
        lengths = np.minimum(base.values[None, :], limits)  # [requests, buckets]
        return [float(v) for v in (_softmax(scores) * lengths).sum(axis=1)]

    def observe(
        self,
        prompt: np.ndarray,
        hidden: np.ndarray | None,
        length: int,
        predicted: float | None = None,
    ) -> None:
        """A request finished having generated `length` tokens; `predicted` is what was
        predicted for it at admission (for the error gauge)."""
        if predicted is not None:
            self._errors.append(abs(predicted - length))
        with self._lock:
            self._history.append(_Sample(prompt, hidden, length))
            self._since_fit += 1
            due = len(self._history) >= MIN_SAMPLES and (
                self._models is None or self._since_fit >= REFIT_EVERY
            )
        if due:
            if self._background:
                self._wake.set()
            else:
                self.refit()

    def refit(self) -> None:
        with self._lock:
            samples = list(self._history)
            self._since_fit = 0
        if len(samples) < MIN_SAMPLES:
            return
        lengths = np.array([s.length for s in samples], dtype=np.float32)
        base = fit_prompt_classifier([s.prompt for s in samples], lengths)
        with_hidden = [s for s in samples if s.hidden is not None]
        refined = None
        if len(with_hidden) >= MIN_SAMPLES:
            refined = fit_hidden_classifier(
                [s.hidden for s in with_hidden],
                np.array([s.length for s in with_hidden], dtype=np.float32),
            )
        self._models = (base, refined)
        self.version += 1

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _refit_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                self.refit()
            except Exception:  # a failed fit keeps the previous model; the engine runs on
                logger.exception("Refitting the output-length predictor failed")
