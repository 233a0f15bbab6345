"""Two ranks as one tensor-parallel group read through `BatchCursor`'s first-batch check: the same
data-parallel rank's batch (``same``) passes, each rank its own (``own``) is refused on both.

    python tests/workers/same_batch.py same|own   (as two ranks: tests/test_units.py)
"""

import sys

import torch.distributed as dist

from fsdp_zero.data.batches import _SyntheticBigram
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed import exit_process

dist.init_process_group("gloo")
layout = BatchLayout(global_batch_size=4, micro_batch_size=2, dp_size=2, grad_accum_steps=1)
rank = 0 if sys.argv[1] == "same" else dist.get_rank()
cursor = BatchCursor(_SyntheticBigram(64, 8, 0), layout, rank, same_as=(dist.group.WORLD,))
try:
    cursor.next_batch()
    cursor.next_batch()  # checked once: no collective here
    print("read", flush=True)
except RuntimeError as e:
    print(e, flush=True)
dist.destroy_process_group()
exit_process(0)  # gloo's threads and the interpreter's teardown: see its docstring
