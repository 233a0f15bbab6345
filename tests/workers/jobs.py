"""Trains configured models through fsdp_zero.training.trainer and saves what the tests compare, several per launch.

    python tests/workers/jobs.py OUT.pt [--config X.yaml] key=value ...    # one job
    python tests/workers/jobs.py --jobs JOBS.json      # [[OUT.pt, [args ...], {options}], ...] in order

Options: ``slow_writes`` (seconds each checkpoint write is delayed: a slow disk, to show that an
async save overlaps training); ``expect_error``: the job is to stop at set-up with a ValueError (the
one line a user would see): OUT.pt holds ``{"error": message}``, or None when it did not.

The ranks are started by torchrun, or by tests/conftest.py's `launch` (torchrun's variables
without its agent). The jobs of a launch run one after another in one process group (the first
job's ``dist`` settings); each builds its model, optimizer, data and run directory afresh, as a
launch of its own would, so the process start-up (3-6 s of a 2-core machine) is paid once per
launch instead of once per configuration. Nothing a job measures comes from the process's RSS,
which earlier jobs would inflate. A job that resumes from a checkpoint belongs in a later launch
than the job that saved it: only a process that never held the state shows that the checkpoint
carries it.

OUT.pt (rank 0): per-step losses, grad norms and learning rates, the full weights before and after
training, the final model's logits on a fixed batch (the data's first two samples), every rank's
model-state bytes after the first optimizer step, the names of the parameters with AdamW states, the wrap plan's
units (padded shard bytes per rank,
parameters per unit), and
what the tests observe of the run itself (each observation is of the effect, not of the config):

    reduce_dtypes       the dtypes of the gradients that reached gloo's reduction (AllReduceScatter)
    units               per FSDP unit, what FSDP2 applied (fsdp_zero.torch_private.fsdp_unit_settings)
    shard_devices       every rank's devices of its parameter shards and AdamW states
    param_bytes         every rank's bytes of the parameters its modules hold at the start of step 1
                        and between the first forward and its backward (gathered units counted whole)
    gather_order        step 1's first forward: 'ag' for each all-gather issued, and each unit's name
                        when it starts computing (FSDP's own pre-forward hook, which gathers and
                        prefetches, runs before it)
    same_reduce_scatter gloo runs: whether AllReduceScatter equals gloo's own reduce-scatter bit for bit
    save_times          each save: (step, time save() was called, time it returned, time the checkpoint
                        was published); monotonic seconds
    writes_done         with ``slow_writes``: when each of this rank's checkpoint writes finished
    loss_times          (call, time) at the end of each loss computation (a forward)
    evals               eval.every > 0: the eval/* scalars by step (fsdp_zero.training.evaluate)
    peak_mib            every rank's (peak over the training's log intervals, peak through its evaluations)
    optim_states        every rank's (AdamW state classes of its shards, bytes of its optimizer states)
                        after training, and the learning rate its optimizer last stepped with
    nf4                 QLoRA runs: every rank's {quantized name: (its local shard's class, bytes of its
                        inner tensors, elements)}; their weights in ``initial``/``final`` are the
                        gathered NF4 tensors dequantized (what the forward computes with)
"""

import contextlib
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_zero.checkpoint import dcp as checkpoint_lib
from fsdp_zero.checkpoint.folders import checkpoint_step
from fsdp_zero.config import RunDir
from fsdp_zero.config.loader import load_config
from fsdp_zero.distributed.env import distributed, exit_process
from fsdp_zero.model.tasks import logits_of
from fsdp_zero.monitor.memory import model_state_bytes
from fsdp_zero.sharding.experts import expert_fqns
from fsdp_zero.sharding.parallelize import AllReduceScatter
from fsdp_zero.torch_private import fsdp_unit_settings, local_shape_and_offset
from fsdp_zero.training.trainer import setup, train

# ---------------------------------------------------------------------------------
# Observers: they wrap the real thing and record what passes through; nothing is replaced.

_seen: dict = {}


def _reset_observations() -> None:
    _seen.clear()
    _seen.update(
        reduce_dtypes=set(),
        gather_order=[],
        recording=False,
        save_times=[],
        loss_times=[],
        writes_done=[],
        tp_collectives=set(),
    )


_reduce = AllReduceScatter.__call__


def _recording_reduce(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
    _seen["reduce_dtypes"].add(str(input_tensor.dtype))
    return _reduce(self, output_tensor, input_tensor, group, op, async_op)


AllReduceScatter.__call__ = _recording_reduce

# What FSDP2's default all-gather calls: all_gather_single from torch 2.15 (the pinned version),
# all_gather_into_tensor before it (the GPU machines' torch 2.11).
_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_all_gather = getattr(dist, _GATHER)


def _recording_all_gather(*args, **kwargs):  # noqa: ANN002, ANN003
    if _seen["recording"]:
        _seen["gather_order"].append("ag")
    return _all_gather(*args, **kwargs)


setattr(dist, _GATHER, _recording_all_gather)

_save, _commit = checkpoint_lib.Checkpointer.save, checkpoint_lib.Checkpointer._commit


def _timed_save(self, parts, train_state, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    record = [train_state.step, time.monotonic(), None, None]
    _seen["save_times"].append(record)
    out = _save(self, parts, train_state, *args, **kwargs)
    record[2] = time.monotonic()
    return out


def _timed_commit(self, partial, final):  # noqa: ANN001
    _commit(self, partial, final)
    for record in _seen["save_times"]:
        if record[0] == checkpoint_step(final):
            record[3] = time.monotonic()


checkpoint_lib.Checkpointer.save, checkpoint_lib.Checkpointer._commit = _timed_save, _timed_commit

_write_data = FileSystemWriter.write_data


def _slow_writes(seconds: float) -> None:
    """Every checkpoint write of this job takes ``seconds`` longer (a slow disk); 0 restores them."""

    def slow(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        time.sleep(seconds)
        out = _write_data(self, *args, **kwargs)
        _seen["writes_done"].append(time.monotonic())  # this rank's shards of one save are on disk
        return out

    FileSystemWriter.write_data = slow if seconds else _write_data


def _param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters the modules hold now: a shard's local part, a gathered unit whole."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _observe_first_forward(parts) -> dict:  # noqa: ANN001
    """Wraps the loss so that step 1's first forward records the all-gather order and the
    parameter bytes held before the step and after that forward."""
    observed = {"before_step": _param_bytes(parts.model), "after_forward": None}

    def computing(name: str) -> None:
        if _seen["recording"]:
            _seen["gather_order"].append(name)

    for name, module in parts.model.named_modules():
        if isinstance(module, FSDPModule):
            module.register_forward_pre_hook(lambda m, a, name=name or "<root>": computing(name))
    loss_fn, calls = parts.loss_fn, [0]

    def observed_loss(model, batch):  # noqa: ANN001
        calls[0] += 1
        _seen["recording"] = calls[0] == 1
        try:
            out = loss_fn(model, batch)
        finally:
            _seen["recording"] = False
        _seen["loss_times"].append([calls[0], time.monotonic()])
        if calls[0] == 1:
            observed["after_forward"] = _param_bytes(parts.model)
        return out

    parts.loss_fn = observed_loss
    return observed


# ---------------------------------------------------------------------------------


def _nf4_full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A QLoRA model's weights, whole: each FSDP unit gathered by FSDP2 itself (``unshard``: its NF4
    weights through their own all-gather hooks, exactly as a forward gathers them), its own tensors
    read (NF4 dequantized), then resharded."""
    full = {}
    for fqn, unit in model.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        unit.unshard()
        prefix = f"{fqn}." if fqn else ""
        for name, p in unit.named_parameters():
            if not hasattr(p, "to_local"):  # this unit's (the others' stay sharded)
                value = p.get_original_weight() if type(p).__name__ == "NF4Tensor" else p
                full[prefix + name] = value.detach().cpu().clone()
        unit.reshard()
    return full


def _nf4_locals(model: torch.nn.Module, names: dict) -> dict:
    """This rank's quantized weights: {name: (local shard class, bytes of its inner tensors, elements)}."""
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        local = params[name].to_local()
        holder = torch.nn.Module()
        holder.register_parameter("w", torch.nn.Parameter(local, requires_grad=False))
        out[name] = (type(local).__name__, model_state_bytes(holder).params, local.numel())
    return out


def full_weights(model: torch.nn.Module, pipeline: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights (under pipeline parallelism every stage's, from its ranks)."""
    # Cloned: at world size 1 on CPU the "full" tensors alias the live parameters.
    # (with cpu_offload only global rank 0 receives them: under pipeline parallelism every stage's
    # first rank must)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=not pipeline)
    )
    full = {k: v.detach().cpu().clone() for k, v in full.items()}
    if pipeline:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, full)
        full = {k: v for stage in every for k, v in stage.items()}
    return full


def reduce_scatter_matches_gloo(world_size: int, rank: int) -> bool:
    """Our all-reduce form against gloo's reduce-scatter, on values spanning 12 orders of magnitude."""
    equal = True
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        numel = world_size * 100_003
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * torch.logspace(
            -6, 6, numel
        )
        ours, theirs = torch.empty(numel // world_size), torch.empty(numel // world_size)
        _reduce(AllReduceScatter(), ours, x.clone(), dist.group.WORLD, op)
        dist.reduce_scatter_tensor(theirs, x.clone(), op=op)
        equal &= torch.equal(ours, theirs)
    flag = torch.tensor(int(equal))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


class _TensorParallelCollectives(TorchDispatchMode):
    """Records the functional collectives tensor parallelism issues (DTensor's: activations, and
    the gradients of what the plan leaves whole), as (kind, dtype, dimensions) of their inputs."""

    _KINDS = {
        torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
        torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
        torch.ops._c10d_functional.all_reduce.default: "all_reduce",
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kind = self._KINDS.get(func)
        if kind:
            _seen["tp_collectives"].add((kind, str(args[0].dtype), args[0].dim()))
        return func(*args, **(kwargs or {}))


def _config(args: list[str]):  # noqa: ANN202
    return load_config(*((args[1], args[2:]) if args[:1] == ["--config"] else (None, args)))


def run_job(  # noqa: ANN001
    out: str, args: list[str], env, slow_writes: float = 0.0, expect_error: bool = False
) -> None:
    cfg = _config(args)
    _slow_writes(slow_writes)
    _reset_observations()
    if expect_error:  # {"error": None}: set-up went through (the test fails, the launch goes on)
        error = None
        try:
            setup(cfg, env)
        except ValueError as e:
            error = str(e)
        if env.is_rank0:
            torch.save({"error": error}, out)
        return
    parts = setup(cfg, env)
    pipeline = parts.built.cut_from is not None
    nf4 = parts.built.levers.get("nf4")
    weights = (lambda m, _: _nf4_full_weights(m)) if nf4 else full_weights
    initial = weights(parts.model, pipeline)
    held = _observe_first_forward(parts)
    # tensor parallelism's collectives observed (the mode costs a little on every op)
    with _TensorParallelCollectives() if cfg.parallel.tp_size > 1 else contextlib.nullcontext():
        result = train(cfg, env, parts)
    # an evaluation at the last step must leave every unit sharded
    held["after_train"] = _param_bytes(parts.model)
    final = weights(parts.model, pipeline)
    opt_states = parts.optimizer.state.values()
    # (sharded: before the forward below)
    names = {id(p): n for n, p in parts.model.named_parameters()}
    # the parameters with AdamW states (rank 0)
    optim_names = sorted(names[id(p)] for p in parts.optimizer.state)
    # Where this rank's shards and AdamW states live, read before the forward below: a forward without
    # backward leaves the root and the last unit gathered (on the device), since their backward
    # never comes.
    devices = {
        str((p.to_local() if hasattr(p, "to_local") else p).device)
        for p in parts.model.parameters()
    }
    devices |= {
        str(v.device)
        for st in opt_states
        for v in st.values()
        if torch.is_tensor(v) and v.dim() > 0
    }
    # (read before the forward below too: it leaves the root and the last unit gathered)
    nf4_locals = _nf4_locals(parts.model, nf4.names) if nf4 else None
    # expert parallelism: each expert weight's local shard on this rank, (shape, offset) in the whole (sharded:
    # before the forward below)
    experts = {
        f"{fqn}.{n}": tuple(tuple(x) for x in local_shape_and_offset(p))
        for fqn in expert_fqns(parts.model)
        for n, p in parts.model.get_submodule(fqn).named_parameters()
        if hasattr(p, "to_local")
    }
    with torch.no_grad():  # the sharded model's outputs on a fixed batch (not of a pipeline stage)
        inputs = parts.cursor.source.batch(range(2))[0]
        output = logits_of(parts.model(inputs.to(env.device)) if not pipeline else torch.zeros(1))
        # loss parallelism: the logits a DTensor split over the vocabulary
        output_placements = str(getattr(output, "placements", None))
        logits = (output.full_tensor() if hasattr(output, "full_tensor") else output).cpu()
    same_reduce_scatter = (
        reduce_scatter_matches_gloo(env.world_size, env.rank) if env.backend == "gloo" else None
    )
    # Every rank's model state, AdamW step counts and dtypes, and where its shards live.
    mine = (
        result.model_state_bytes,
        sorted({int(st["step"]) for st in opt_states}),
        # (offload.states: only the device's groups hold their moments between steps)
        sorted({str(st["exp_avg"].dtype) for st in opt_states if "exp_avg" in st}),
        sorted(devices),
        held,
        sorted(_seen["reduce_dtypes"]),
        (result.peak_rss_mib, result.eval_peak_mib),
        nf4_locals,
        (
            sorted(
                {
                    type(getattr(v, "_local_tensor", v)).__name__
                    for st in opt_states
                    for k, v in st.items()
                    if k.startswith("exp_avg")
                }
            ),
            model_state_bytes(parts.model, parts.optimizer).optimizer,
            float(parts.optimizer.param_groups[0]["lr"]),
        ),
    )
    offload = None
    if hasattr(parts.optimizer, "resident"):  # offload.states (fsdp_zero/sharding/offload.py)
        store = parts.optimizer.store
        folder = getattr(store, "folder", None)
        offload = {
            "resident": parts.optimizer.resident(),
            "on_device": parts.optimizer.on_device(),
            "traffic": vars(parts.optimizer.traffic()),
            "formula": vars(parts.optimizer.traffic_formula()),
            "folder": folder,
            "folder_left": folder is not None and os.path.exists(folder),
            "groups": [(g.tier.value, g.moved) for g in parts.optimizer.groups],
            "numel": sum(g.numel for g in parts.optimizer.groups),
            "disk_writes": getattr(store, "writes", 0),
        }
    mine = (*mine, offload, experts)
    states = [None] * env.world_size
    dist.all_gather_object(states, mine)
    units = {
        name or "<root>": fsdp_unit_settings(m)
        for name, m in parts.model.named_modules()
        if isinstance(m, FSDPModule)
    }
    if env.is_rank0:
        log = RunDir(parts.run_dir).metric_rows()
        # the rate each logged step used (not eval rows)
        lrs = {row["step"]: row["lr"] for row in log if "lr" in row}
        torch.save(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "lrs": lrs,
                "initial": initial,
                "final": final,
                "logits": logits,
                "output_placements": output_placements,
                "model_state_bytes": [s[0] for s in states],
                "adam_steps": [s[1] for s in states],
                "adam_dtypes": [s[2] for s in states],
                "shard_devices": [s[3] for s in states],
                "param_bytes": [s[4] for s in states],
                "reduce_dtypes": sorted({d for s in states for d in s[5]}),
                "units": {
                    k: {n: str(v) if isinstance(v, torch.dtype) else v for n, v in u.items()}
                    for k, u in units.items()
                },
                "gather_order": list(_seen["gather_order"]),
                "tp_collectives": sorted(_seen["tp_collectives"]),
                "save_times": _seen["save_times"],
                "loss_times": _seen["loss_times"],
                "writes_done": _seen["writes_done"],
                "breakdown": result.breakdown,
                "phases": {phase.value: dict(cats) for phase, cats in result.phases.items()},
                "dtypes": sorted({str(v.dtype) for v in final.values() if v.is_floating_point()}),
                "loss_scale": {r["step"]: r["loss_scale"] for r in log if "loss_scale" in r},
                "skipped_steps": {
                    r["step"]: r["skipped_steps"] for r in log if "skipped_steps" in r
                },
                "num_params": parts.num_params,
                "shard_bytes": [u.bytes_per_rank for u in parts.plan.units],
                "unit_params": {u.fqn or "<root>": u.num_params for u in parts.plan.units},
                "last_unit": None if pipeline else parts.plan.last_unit(parts.model),
                "same_reduce_scatter": same_reduce_scatter,
                "evals": result.evals,
                "peak_mib": [s[6] for s in states],
                "optim_names": optim_names,
                "num_frozen": parts.num_frozen,
                "nf4": [s[7] for s in states] if nf4 else None,
                "optim_states": [s[8] for s in states],
                # the class of every Linear-like module (float8 swaps some for torchao's Float8Linear)
                "linear_classes": {
                    n: type(m).__name__
                    for n, m in parts.model.named_modules()
                    if isinstance(m, torch.nn.Linear)
                },
                # ... and of their weights' local shards (MXFP8 wraps the weight, not the module)
                "linear_weights": {
                    n: type(getattr(m.weight, "_local_tensor", m.weight)).__name__
                    for n, m in parts.model.named_modules()
                    if isinstance(m, torch.nn.Linear)
                },
                "nf4_numel": nf4.numel if nf4 else 0,
                "offload": [s[9] for s in states],
                "experts": [s[10] for s in states],
                # the last logged step's row (memory/*, comm/*)
                "last_row": [r for r in log if "loss" in r][-1] if log else {},
            },
            out,
        )


def main() -> None:
    if sys.argv[1] == "--jobs":
        with open(sys.argv[2]) as f:
            jobs = json.load(f)
    else:
        jobs = [[sys.argv[1], sys.argv[2:]]]
    settings = _config(jobs[0][1]).dist
    for out, args, *_ in jobs:  # one process group serves them all
        assert _config(args).dist == settings, (
            f"{out}: dist settings differ from the launch's first job"
        )
    with distributed(settings) as env:
        for out, args, *options in jobs:
            try:
                run_job(out, args, env, **(options[0] if options else {}))
            except Exception:
                print(
                    f"[rank{env.rank}] job {out} failed: {' '.join(args)}",
                    file=sys.stderr,
                    flush=True,
                )
                raise
            # a loss with a call counter: each job from 0
            user_model = sys.modules.get("tests.user_model")
            if user_model is not None:
                user_model._calls[0] = 0
            gc.collect()
            dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
