"""Ending a serve process once its work is done, without the interpreter's teardown.

With torch, transformers and the model's modules loaded, Python's exit (module by module,
every custom op library's finalizer) takes ~0.5-0.8 s on a 2-core machine: time a
stopping server would spend after everything that matters is closed. The API process (once
uvicorn and the engine have shut down), the engine core's process (once its workers have)
and each `mp` rank (after `Shutdown`) end here instead; each flushes its logs and standard
streams first. Nothing registered with `atexit` runs: a process that ends here closes what
it holds in its own shutdown.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe nobody reads
            pass
    os._exit(code)
