"""A GPU machine, simulated on one without: torch reports FSDP_ZERO_FAKE_GPUS GPUs.

On the PYTHONPATH of a run (tests/test_cli.py; `make test-gpu-host` for the whole suite), this makes
``torch.cuda.is_available()`` true and ``torch.cuda.device_count()`` N, as on a machine with N GPUs,
so a test can check that CPU tests stay on the CPU there. It honours ``CUDA_VISIBLE_DEVICES`` as the
CUDA driver does when it starts: an empty value hides every GPU (read when asked, so a process that
hides its GPUs before asking, as tests/conftest.py does, sees none). Nothing else is faked: code that
really uses CUDA fails, which is the point.
"""

import os

_n = int(os.environ.get("FSDP_ZERO_FAKE_GPUS", "0"))


def _visible() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return _n if visible is None else min(_n, len([d for d in visible.split(",") if d.strip()]))


if _n:
    import torch

    torch.cuda.is_available = lambda: _visible() > 0
    torch.cuda.device_count = _visible

if os.environ.get(
    "FSDP_ZERO_MUTANT"
):  # under tests/mutants.py: its sitecustomize too (only the first on the path loads)
    import importlib.util

    _site = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "mutant_site",
        "sitecustomize.py",
    )
    _spec = importlib.util.spec_from_file_location("_mutant_sitecustomize", _site)
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
