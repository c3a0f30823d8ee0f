"""The sjf output-length predictor learns, online, what the length depends on: the prompt's
tokens, or the model's hidden state at the last prompt token."""

from __future__ import annotations

import time

import numpy as np
import pytest

from serve.scheduler.length_predictor import (
    MIN_SAMPLES,
    HiddenProjection,
    OutputLengthPredictor,
    prompt_features,
)

CAP = 512  # every request's max_tokens: the cap says nothing of the length
SHORT_TOKEN, LONG_TOKEN = 17, 4242


def synthetic_request(rng: np.random.Generator) -> tuple[list[int], int]:
    """A random prompt whose instruction token decides the length class: ~4 or ~300."""
    prompt = rng.integers(100, 4000, size=int(rng.integers(5, 60))).tolist()
    if rng.random() < 0.5:
        return [*prompt, SHORT_TOKEN], int(rng.integers(1, 8))
    return [*prompt, LONG_TOKEN], int(rng.integers(250, 350))


def test_it_predicts_nothing_until_it_has_seen_enough() -> None:
    predictor = OutputLengthPredictor(background=False)
    rng = np.random.default_rng(0)
    for _ in range(MIN_SAMPLES - 1):
        prompt, length = synthetic_request(rng)
        predictor.observe(prompt_features(prompt, CAP), None, length)
    assert predictor.predict(prompt_features([1, 2, 3], CAP)) is None
    assert predictor.mean_absolute_error is None
    prompt, length = synthetic_request(rng)
    predictor.observe(prompt_features(prompt, CAP), None, length)
    assert predictor.predict(prompt_features([1, 2, 3], CAP)) is not None


def test_prompt_tokens_beat_a_constant_guess_by_far() -> None:
    rng = np.random.default_rng(1)
    predictor = OutputLengthPredictor(background=False)
    seen = []
    for _ in range(400):
        prompt, length = synthetic_request(rng)
        features = prompt_features(prompt, CAP)
        # What the error gauge reports: the prediction made before the request ran.
        predictor.observe(features, None, length, predictor.predict(features))
        seen.append(length)
    constant = float(np.mean(seen))
    tests = [synthetic_request(rng) for _ in range(200)]
    predicted = [predictor.predict(prompt_features(p, CAP)) for p, _ in tests]
    actual = np.array([length for _, length in tests])
    model_error = np.mean(np.abs(np.array(predicted) - actual))
    constant_error = np.mean(np.abs(constant - actual))
    assert constant_error > 100  # the classes are far apart: guessing the mean is poor
    assert model_error < constant_error / 3
    # The gauge follows: late predictions were good, so the recent error is small too.
    assert predictor.mean_absolute_error < constant_error / 2


def test_no_prediction_exceeds_the_request_s_own_cap() -> None:
    """A long-class prompt with a cap of 20 cannot generate ~300 tokens: each bucket counts
    up to the cap, so the prediction is at most 20; a cap above every bucket changes
    nothing."""
    rng = np.random.default_rng(4)
    predictor = OutputLengthPredictor(background=False)
    for _ in range(200):
        prompt, length = synthetic_request(rng)
        predictor.observe(prompt_features(prompt, CAP), None, length)
    long_prompt, short_prompt = [5, 6, LONG_TOKEN], [5, 6, SHORT_TOKEN]
    uncapped = predictor.predict(prompt_features(long_prompt, CAP))
    assert uncapped > 200
    assert predictor.predict(prompt_features(long_prompt, CAP), cap=CAP) == pytest.approx(uncapped)
    capped = predictor.predict(prompt_features(long_prompt, 20), cap=20)
    assert 15 < capped <= 20
    short = predictor.predict(prompt_features(short_prompt, CAP))
    assert predictor.predict(prompt_features(short_prompt, CAP), cap=20) <= min(20, short)
    many = predictor.predict_many(
        [prompt_features(long_prompt, CAP)] * 3, [None] * 3, [1, 100, CAP]
    )
    assert many[0] == pytest.approx(1.0) and many[1] <= 100 and many[2] == pytest.approx(uncapped)


def test_the_hidden_state_refines_what_the_prompt_cannot_tell() -> None:
    """Prompts alike; the length follows a direction of the (synthetic) hidden state."""
    rng = np.random.default_rng(2)
    hidden_size = 24
    direction = rng.standard_normal(hidden_size)
    projection = HiddenProjection(hidden_size)
    predictor = OutputLengthPredictor(background=False)

    def request() -> tuple[np.ndarray, np.ndarray, int]:
        hidden = rng.standard_normal(hidden_size)
        length = int(rng.integers(250, 350)) if hidden @ direction > 0 else int(rng.integers(1, 8))
        prompt = rng.integers(100, 4000, size=20).tolist()
        return prompt_features(prompt, CAP), projection(hidden.tolist()), length

    for _ in range(400):
        features, hidden, length = request()
        predictor.observe(features, hidden, length)
    tests = [request() for _ in range(200)]
    actual = np.array([length for *_, length in tests])
    with_hidden = np.array([predictor.predict(f, h) for f, h, _ in tests])
    prompt_only = np.array([predictor.predict(f) for f, _, _ in tests])
    assert np.mean(np.abs(with_hidden - actual)) < np.mean(np.abs(prompt_only - actual)) / 2


def test_refits_run_in_the_background() -> None:
    predictor = OutputLengthPredictor()  # background=True: the engine's
    rng = np.random.default_rng(3)
    try:
        for _ in range(MIN_SAMPLES):
            prompt, length = synthetic_request(rng)
            predictor.observe(prompt_features(prompt, CAP), None, length)
        deadline = time.monotonic() + 10
        while not predictor.is_active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert predictor.is_active
        short = predictor.predict(prompt_features([5, 6, SHORT_TOKEN], CAP))
        long = predictor.predict(prompt_features([5, 6, LONG_TOKEN], CAP))
        assert short < long
    finally:
        predictor.close()
