"""RequestLimits: how much one request may ask for, each bounded by a flag. A leaf module
that imports nothing, so that the command line reads the defaults without loading the
server (request_checks.check_limits applies them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128  # n and best_of, so also the beam width (--max-n)
    max_stop_sequences: int = 64  # entries of stop, stop_token_ids, bad_words, each
    max_logit_bias: int = 1024  # logit_bias entries (--max-logit-bias)
