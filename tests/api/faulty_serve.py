"""`python tests/api/faulty_serve.py [serve flags]`: the `serve` CLI with a fault injected,
chosen by SERVE_TEST_FAULT:

- `forward-once-exists:PATH`: every forward pass raises, as a CUDA fault would, once the
  file PATH exists (the test creates it mid-generation).
- `decode-prompt:TEXT`: decoding the output text of a request whose prompt contains TEXT
  raises (in the API process, whose output processor decodes text); other requests are
  untouched.

The patch runs at import, so it runs in both processes: multiprocessing's spawn imports
this script in the engine core process as `__mp_main__` before it starts the core.
"""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


def _inject(fault: str) -> None:
    kind, _, arg = fault.partition(":")
    if kind == "forward-once-exists":
        from serve.worker.model_runner import ModelRunner

        run = ModelRunner.execute_model

        def faulty_run(self, *args, **kwargs):
            if os.path.exists(arg):
                raise InjectedFault("CUDA error: an illegal memory access was encountered")
            return run(self, *args, **kwargs)

        ModelRunner.execute_model = faulty_run
    elif kind == "decode-prompt":
        from serve.engine.detokenizer import IncrementalDetokenizer

        update = IncrementalDetokenizer.update

        def faulty_update(self, output_token_ids):
            prompt = self.tokenizer.decode(self.prompt_token_ids)
            if arg in prompt and len(output_token_ids) >= 3:
                raise InjectedFault("cannot decode this request's text")
            return update(self, output_token_ids)

        IncrementalDetokenizer.update = faulty_update
    else:
        raise SystemExit(f"unknown SERVE_TEST_FAULT {fault!r}")


if os.environ.get("SERVE_TEST_FAULT"):
    _inject(os.environ["SERVE_TEST_FAULT"])

if __name__ == "__main__":
    from serve.api.cli import main

    main()
