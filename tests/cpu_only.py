"""The test process sees no GPU (tests/conftest.py imports this before anything else).

``CUDA_VISIBLE_DEVICES=""`` is set before anything asks CUDA (its driver reads it once, when it starts):
on a GPU host torch would otherwise start CUDA in the test process by itself, every optimizer step
asking the accelerator for its current stream. ``VISIBLE`` keeps the machine's own setting for the
processes the gpu tests start (`tests.conftest.gpu_env`).
"""

import os

VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
