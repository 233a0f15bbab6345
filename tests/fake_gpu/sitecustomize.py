"""A GPU machine, simulated on one without: torch reports FSDP_ZERO_FAKE_GPUS GPUs.

On the PYTHONPATH of a test's run (tests/test_cli.py), this makes
``torch.cuda.is_available()`` true and ``torch.cuda.device_count()`` N, as on a machine
with N GPUs, so the test can check that CPU tests stay on the CPU there. It honours
``CUDA_VISIBLE_DEVICES`` as the CUDA driver does: an empty value hides every GPU.
Nothing else is faked: code that really uses CUDA fails, which is the point.
"""

import os

_n = int(os.environ.get("FSDP_ZERO_FAKE_GPUS", "0"))
_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
if _visible is not None:
    _n = min(_n, len([d for d in _visible.split(",") if d.strip()]))
if _n:
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: _n
