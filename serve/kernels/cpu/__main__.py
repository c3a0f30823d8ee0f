"""`python -m serve.kernels.cpu [--require]`: build (or find) the native CPU kernels now.

`make install` runs it (unavailable is not an error there: the torch reference runs);
the Docker build passes `--require`, so an image never ships without them.
"""

import logging
import sys

from serve.kernels.cpu import native

logging.basicConfig(level=logging.INFO, format="%(message)s")
ready = native.available()
print(f"native CPU kernels: {'ready' if ready else 'unavailable'} in {native.build_dir()}")
sys.exit(1 if "--require" in sys.argv[1:] and not ready else 0)
