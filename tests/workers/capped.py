"""Runs a script under an OS-enforced cap on this process's data segment (RLIMIT_DATA: heap and
anonymous mappings, so every tensor on the CPU), as a scheduler's per-process memory limit would.

    FSDP_ZERO_DATA_CAP=<bytes> python tests/workers/capped.py SCRIPT [args ...]
"""

import os
import resource
import runpy
import sys

cap = int(os.environ["FSDP_ZERO_DATA_CAP"])
resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
