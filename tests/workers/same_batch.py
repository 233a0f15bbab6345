"""Two ranks read through `BatchCursor`'s first-batch check with the groups `Topology.same_batch`
gives the trainer, first as one tensor-parallel group (tp 2), then as one pipeline (pp 2): the same
data-parallel rank's batch (``same``) passes, each rank its own (``own``) is refused on both, in
both layouts.

    python tests/workers/same_batch.py same|own   (as two ranks: tests/test_units.py)
"""

import sys

import torch.distributed as dist

from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.data.batches import _SyntheticBigram
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed import Topology, exit_process
from fsdp_zero.distributed.topology import Role

dist.init_process_group("gloo")
layout = BatchLayout(global_batch_size=4, micro_batch_size=2, dp_size=2, grad_accum_steps=1)
for kind in ("tp_size", "pp_size"):
    topology = Topology.of(ParallelConfig(**{kind: 2}), 2).on("cpu")
    batch_rank = topology.rank(Role.BATCH, dist.get_rank())
    rank = batch_rank if sys.argv[1] == "same" else dist.get_rank()
    cursor = BatchCursor(_SyntheticBigram(64, 8, 0), layout, rank, same_as=topology.same_batch())
    try:
        cursor.next_batch()
        cursor.next_batch()  # checked once: no collective here
        print(f"{kind}: read", flush=True)
    except RuntimeError as e:
        print(f"{kind}: {e}", flush=True)
dist.destroy_process_group()
exit_process(0)  # gloo's threads and the interpreter's teardown: see its docstring
