"""The grammar manager, built on first use: importing xgrammar (~0.6 s) and indexing the
vocabulary take seconds that a server, engine core or rank without grammars should not pay
at start-up. This module imports neither xgrammar nor torch; structured_output.py holds the
manager itself."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.worker.structured_output import StructuredOutputManager


class LazyStructuredOutput:
    """A StructuredOutputManager built on first use: importing xgrammar and indexing the
    vocabulary take seconds that servers without grammars should not pay at start-up.
    Thread-safe: the engine loop and the API's thread may both be first. `make_tokenizer`
    is called then, once (a worker loads the tokenizer only if a grammar comes)."""

    def __init__(
        self, make_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        self._make_tokenizer = make_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self.built: StructuredOutputManager | None = None  # None until first use
        self._closed = False

    def close(self) -> None:
        """Stop the compile thread and drop the compiled grammars, if any were built: an
        `LLM` kept after its shutdown would hold them. Idempotent."""
        with self._lock:
            self._closed = True
            built, self.built = self.built, None
        if built is not None:
            built.shutdown()

    def get(self) -> StructuredOutputManager:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar manager is closed (its engine shut down)")
            if self.built is None:
                from serve.worker.structured_output import StructuredOutputManager

                self.built = StructuredOutputManager(
                    self._make_tokenizer(), self._vocab_size, self._eos_token_ids
                )
        return self.built
