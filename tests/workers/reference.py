"""tests/reference.py's single-process loop in a process of its own, for the gpu tests (the suite's own
process sees no GPU: tests/conftest.py).

    python tests/workers/reference.py OUT.pt DEVICE key=value ...

Saves `tests.reference.reference_run`'s result (losses, norms, learning rates, initial and final weights,
on the CPU) for the config the overrides make, trained on DEVICE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `tests`

from fsdp_zero.config.loader import load_config  # noqa: E402
from tests.reference import reference_run  # noqa: E402

if __name__ == "__main__":
    out, device, *overrides = sys.argv[1:]
    torch.save(reference_run(load_config(None, overrides), device=device), out)
