"""Activation offload (parallel.activation_offload): the checkpointed blocks' inputs moved to the
host in forward and brought back for the recompute leave losses, gradients and weights bit for bit
those of checkpointing alone, move exactly the blocks' inputs (nothing saved inside a block, no
parameter, no buffer) and count them; the planner's formula says where checkpointing's peak is and
what offload saves. In-process on one rank of gloo, and one run of the shared 2-rank launch.

Covers: fsdp_zero/sharding/act_offload.py, the ACTIVATION_OFFLOAD row of fsdp_zero/sharding/levers.py,
fsdp_zero/tools/formulas.py (activation_peaks_by_block), fsdp_zero/tools/layout.py (offload_peaks)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_zero.config.loader import load_config
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.model.transformer import _args_from_config
from fsdp_zero.sharding.act_offload import ActivationOffload, _Packed
from fsdp_zero.sharding.build import build
from fsdp_zero.tools.formulas import activation_peaks_by_block
from fsdp_zero.tools.layout import Workload, offload_peaks, saved_per_unit
from fsdp_zero.torch_private import checkpoint_activations, storage_key
from tests.batches.settings import BASE
from tests.conftest import build_model
from tests.test_cli import scalars

TINY = ("model.preset=gpt_tiny",)
BATCH, SEQ = 2, 32
MIB = 2**20


def _train(env: DistEnv, *overrides: str, steps: int = 3) -> list[tuple]:
    """``steps`` AdamW steps of gpt_tiny built by the trainer's build (ZeRO-3 on one rank): each
    step's (loss, gradients, the bytes activation offload counted, or None when it is off)."""
    built = build(load_config(None, [*TINY, *overrides]), env, seed=0)
    offload = built.levers.get("activation_offload")
    tokens = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        batch = torch.randint(0, 512, (BATCH, SEQ + 1), generator=tokens)
        logits = built.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        grads = [p.grad.full_tensor().clone() for p in built.model.parameters()]
        built.optimizer.step()
        built.optimizer.zero_grad()
        out.append((loss.detach(), grads, offload.take() if offload else None))
    return out


@pytest.mark.parametrize("checkpointing, blocks", [("full", 4), ("selective", 2)])
def test_offload_trains_bit_for_bit_and_counts_the_checkpointed_inputs(
    one_rank, checkpointing: str, blocks: int
):
    """With offload, 3 steps' losses and every gradient equal checkpointing alone's (torch.equal);
    each step moves the checkpointed blocks' inputs exactly, blocks x B x S x dim x 4 bytes
    (gpt_tiny: 4 blocks of dim 128; selective checkpoints every 2nd: half)."""
    on = ("parallel.activation_checkpointing=" + checkpointing,)
    plain = _train(one_rank, *on)
    offloaded = _train(one_rank, *on, "parallel.activation_offload=true")
    dim = _args_from_config(load_config(None, list(TINY)).model).dim
    for (loss, grads, none), (loss_o, grads_o, moved) in zip(plain, offloaded):
        assert none is None
        assert torch.equal(loss, loss_o)
        assert all(torch.equal(g, g_o) for g, g_o in zip(grads, grads_o, strict=True))
        assert moved == blocks * BATCH * SEQ * dim * 4


class _Seen(ActivationOffload):
    """ActivationOffload that keeps what its pack was given and returned."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__(root)
        self.seen: list[tuple[torch.Tensor, object]] = []

    def pack(self, tensor: torch.Tensor) -> object:
        packed = super().pack(tensor)
        self.seen.append((tensor, packed))
        return packed


def test_the_hooks_move_only_the_blocks_inputs_as_host_copies():
    """On the built-in model, checkpointed and offloaded block by block: the hooks see each block's
    inputs only (the hidden states and the rotary table, a view of the model's buffer, which stays);
    each hidden state moved is no parameter and no buffer view and goes to a host tensor of its own
    with its values; the recompute brings them back (the gradients equal checkpointing alone's)."""
    args = _args_from_config(load_config(None, list(TINY)).model)
    torch.manual_seed(0)
    model = build_model(args, device="cpu")
    reference = build_model(args, device="cpu")
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        for block in m.layers.values():
            checkpoint_activations(block)
    offload = _Seen(model)
    offload.install(list(model.layers.values()))
    batch = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator())
    for m in (model, reference):
        logits = m(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    buffers = {storage_key(b)[0] for b in model.buffers()}
    moved = [(t, p) for t, p in offload.seen if isinstance(p, _Packed)]
    kept = [t for t, p in offload.seen if not isinstance(p, _Packed)]
    assert len(moved) == len(kept) == args.n_layers  # one hidden state and one table a block
    assert all(storage_key(t)[0] in buffers for t in kept)  # the rotary table, left in place
    for tensor, packed in moved:
        assert not isinstance(tensor, nn.Parameter) and storage_key(tensor)[0] not in buffers
        assert tensor.shape == (BATCH, SEQ, args.dim)
        assert packed.host.device.type == "cpu"
        assert storage_key(packed.host)[0] != storage_key(tensor)[0]  # a copy, not the tensor
        assert torch.equal(packed.host, tensor)
    assert offload.take() == args.n_layers * BATCH * SEQ * args.dim * 4
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_the_shared_launchs_offloaded_run_is_checkpointings_bit_for_bit(batches):
    """ac-offload (2 ranks, ZeRO-3 with CPU offload, full checkpointing, memory.profile_step=2)
    against ac-full, the same run without activation offload: losses, gradient norms and the final
    weights equal; each rank's memory/offloaded_activations_mib at every step is its blocks' inputs
    by formula: micro-batches x blocks x B x S x dim x 4 bytes."""
    plain, offloaded = batches["ac-full"], batches["ac-offload"]
    assert plain["losses"] == offloaded["losses"] and len(plain["losses"]) == 8
    assert plain["grad_norms"] == offloaded["grad_norms"]
    assert all(torch.equal(plain["final"][k], v) for k, v in offloaded["final"].items())
    cfg = load_config(None, list(BASE))
    args, train = _args_from_config(cfg.model), cfg.train
    per_rank = train.global_batch_size // 2  # samples a rank steps on
    expected = args.n_layers * per_rank * cfg.data.seq_len * args.dim * 4
    for rank in range(2):
        tags = scalars(batches.path("ac-offload") / "tb" / f"rank{rank}")
        values = tags["memory/offloaded_activations_mib"]
        assert [s for s, _ in values] == list(range(1, 9))
        assert all(v == pytest.approx(expected / MIB, rel=1e-6) for _, v in values)


def _workload(*overrides: str) -> Workload:
    return Workload.of(
        load_config(
            None,
            [
                *TINY,
                f"data.seq_len={SEQ}",
                f"train.micro_batch_size={BATCH}",
                f"train.global_batch_size={BATCH}",
                "parallel.activation_checkpointing=full",
                *overrides,
            ],
        )
    )


@pytest.mark.parametrize("vocab, where", [(512, "recompute"), (32768, "forward")])
def test_the_planner_says_where_checkpointings_peak_is_and_what_offload_moves(vocab, where):
    """gpt_tiny: a block saves ~12 KiB a token, the head and loss ~4 KiB at vocabulary 512 and
    ~260 KiB at 32,768. At 512 the peak is the recompute of the last block (its activations with
    the three blocks' inputs before it); at 32,768 the end of forward (every block's input with the
    logits). Both by hand from saved_per_unit; offload moves 4 x B x S x dim x 4 bytes and takes
    them out of both sums (a recompute keeps its own block's activations)."""
    w = _workload(f"model.vocab_size={vocab}")
    off, on = offload_peaks(w)
    saved = saved_per_unit(w, 1)
    dim, b = 128, BATCH * SEQ * 128 * 4
    head = saved["norm"] + saved["output"]
    embed = saved["tok_embeddings"]
    assert dim == _args_from_config(load_config(None, list(TINY)).model).dim
    blocks = [f"layers.{i}" for i in range(4)]
    recompute = max(embed + i * b + saved[blk] for i, blk in enumerate(blocks))
    assert (off.forward, off.recompute, off.offloaded) == (embed + 4 * b + head, recompute, 4 * b)
    assert off.where == where
    assert on.forward == embed + head
    assert on.recompute == max(embed + saved[blk] for blk in blocks)
    assert on.offloaded == off.offloaded
    selective = activation_peaks_by_block(saved, blocks, blocks[1::2], b)
    assert selective.offloaded == 2 * b
    assert selective.forward == embed + saved["layers.0"] + b + saved["layers.2"] + b + head
