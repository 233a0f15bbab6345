"""A wrong behaviour injected into every Python process of a test run (tests/mutants.py).

On the PYTHONPATH with FSDP_ZERO_MUTANT=<name>, Python imports this at start-up in the test
process and in every process a test launches (torchrun's agent, its ranks, plain runs). Each
mutant wraps a public torch API (or one function of ours) so that a setting is silently ignored
or done wrongly, as a bug would, and writes a line to $FSDP_ZERO_MUTANT_LOG the first time it
changes something, so tests/mutants.py can tell a mutant the suite caught from one that never ran.
Without FSDP_ZERO_MUTANT nothing happens.

Where no public API carries the lever (an expression inside one of our functions), a mutant is a
source edit: our module is loaded from its own file with one exact piece of text replaced (`SOURCE`
in source_mutants.py, beside this file; the text must occur exactly once, or nothing is applied). The
replacement calls ``__mutant__()`` where the changed code runs, so "applied" means the wrong code ran,
not merely that it was loaded.
For trying a new one without editing this file: ``FSDP_ZERO_MUTANT=source`` with
``FSDP_ZERO_MUTANT_SOURCE='{"module": "fsdp_zero.x", "old": "...", "new": "..."}'``.
"""

import os

_NAME = os.environ.get("FSDP_ZERO_MUTANT")
_applied = False


def _applied_once() -> None:
    global _applied
    if not _applied and os.environ.get("FSDP_ZERO_MUTANT_LOG"):
        _applied = True
        with open(os.environ["FSDP_ZERO_MUTANT_LOG"], "a") as f:
            f.write(f"{os.getpid()}\n")


def _wrap_fully_shard(change, units: bool = True, root: bool = True) -> None:  # noqa: ANN001
    """fully_shard with its keyword arguments changed by ``change(kwargs) -> bool`` (True: changed), on
    the inner units, the root (the module that already holds units), or both."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    def fully_shard(module, **kwargs):  # noqa: ANN001, ANN003
        is_root = any(isinstance(m, fsdp.FSDPModule) for m in module.modules() if m is not module)
        if (root if is_root else units) and change(kwargs):
            _applied_once()
        return original(module, **kwargs)

    fsdp.fully_shard = fully_shard


def _reduce_in_param_dtype(kwargs: dict) -> bool:
    """Mixed precision reduces gradients in the 16-bit compute dtype instead of fp32."""
    import dataclasses

    policy = kwargs.get("mp_policy")
    if policy is None or policy.param_dtype is None or policy.reduce_dtype == policy.param_dtype:
        return False
    kwargs["mp_policy"] = dataclasses.replace(policy, reduce_dtype=policy.param_dtype)
    return True


def _offload_ignored(kwargs: dict) -> bool:
    """parallel.cpu_offload reaches the config but not FSDP2."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not isinstance(kwargs.get("offload_policy"), CPUOffloadPolicy):
        return False
    kwargs["offload_policy"] = OffloadPolicy()
    return True


def _always_reshard(kwargs: dict) -> bool:
    """reshard_after_forward forced to True: on the units, ZeRO-2 and hpZ silently become ZeRO-3; on
    the root, it is freed after forward and gathered again at once for backward."""
    if kwargs.get("reshard_after_forward", True) is True:
        return False
    kwargs["reshard_after_forward"] = True
    return True


def _prefetch_ignored() -> None:
    """parallel.prefetch: the explicit prefetch lists are never set."""
    from torch.distributed.fsdp import FSDPModule

    def ignore(self, modules):  # noqa: ANN001
        if modules:
            _applied_once()

    FSDPModule.set_modules_to_forward_prefetch = ignore
    FSDPModule.set_modules_to_backward_prefetch = ignore


def _clipping_ignored() -> None:
    """optim.grad_clip: the norm is computed and logged, the gradients are never scaled."""
    import torch.nn.utils

    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):  # noqa: ANN001
        _applied_once()

    torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_


def _checkpointing_ignored() -> None:
    """parallel.activation_checkpointing: the blocks are never marked for recomputation."""
    import torch.distributed._composable as composable

    def checkpoint(module, **kwargs):  # noqa: ANN001, ANN003
        _applied_once()
        return module

    composable.checkpoint = checkpoint


def _async_save_waits() -> None:
    """checkpoint.async_save: the save is written before training goes on (a synchronous save)."""
    import torch.distributed.checkpoint as dcp

    original = dcp.async_save

    def async_save(*args, **kwargs):  # noqa: ANN002, ANN003
        future = original(*args, **kwargs)
        future.result()
        _applied_once()
        return future

    dcp.async_save = async_save


def _on_import(name: str, patch, compile_with=None) -> None:  # noqa: ANN001
    """Calls ``patch(module)`` once our module ``name`` has been imported (before anyone uses it); or,
    with ``compile_with(spec, loader)``, runs the code object it returns as the module instead of the
    module's own (None: the module's own)."""
    import importlib.abc
    import importlib.util
    import sys

    class Patch(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):  # noqa: ANN001
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            loader = spec.loader

            class Loader(importlib.abc.Loader):
                def create_module(self, spec):  # noqa: ANN001
                    return loader.create_module(spec)

                def exec_module(self, module):  # noqa: ANN001
                    code = compile_with(spec, loader) if compile_with else None
                    if code is None:
                        loader.exec_module(module)
                    else:
                        module.__dict__["__mutant__"] = _mutant
                        exec(code, module.__dict__)
                    if patch:
                        patch(module)

            spec.loader = Loader()
            return spec

    sys.meta_path.insert(0, Patch())


def _schedule_one_step_late() -> None:
    """The learning-rate schedule one step behind (the warm-up starts a step late): ours, patched
    when fsdp_zero.training.step is imported."""

    def patch(module):  # noqa: ANN001
        original = module.lr_factor

        def lr_factor(step, cfg, total_steps):  # noqa: ANN001
            _applied_once()
            return original(max(step - 1, 0), cfg, total_steps)

        module.lr_factor = lr_factor

    _on_import("fsdp_zero.training.step", patch)


def _grad_sync_ignored() -> None:
    """parallel.grad_sync: FSDP2's deferral switches do nothing, so every micro-batch still reduces
    (NVIDIA cosmos #161's silent no-op)."""
    from torch.distributed.fsdp import FSDPModule

    def ignore(self, flag, *, recurse=True):  # noqa: ANN001
        if not flag:
            _applied_once()

    FSDPModule.set_requires_gradient_sync = ignore
    FSDPModule.set_requires_all_reduce = ignore


def _all_reduce_uncounted() -> None:
    """comm/all_reduce_mib: FSDP2's hook after HSDP's all-reduce is never installed."""
    from torch.distributed.fsdp import FSDPModule

    def ignore(self, hook, *, stream=None):  # noqa: ANN001
        _applied_once()

    FSDPModule.set_all_reduce_hook = ignore


def _step_groups_ignored() -> None:
    """optim.step_group_size: the groups never cut (ours, patched when fsdp_zero.sharding.optim is imported): AdamW
    steps the whole shard at once."""

    def patch(module):  # noqa: ANN001
        original = module.step_groups

        def step_groups(params, size):  # noqa: ANN001
            if size and len(original(params, size)) > 1:
                _applied_once()
            return original(params, 0)

        module.step_groups = step_groups

    _on_import("fsdp_zero.sharding.optim", patch)


MUTANTS = {
    "reduce-in-bf16": lambda: _wrap_fully_shard(_reduce_in_param_dtype),
    "offload-ignored": lambda: _wrap_fully_shard(_offload_ignored),
    "always-reshard": lambda: _wrap_fully_shard(_always_reshard, root=False),
    "root-resharded": lambda: _wrap_fully_shard(_always_reshard, units=False),
    "prefetch-ignored": _prefetch_ignored,
    "clipping-ignored": _clipping_ignored,
    "checkpointing-ignored": _checkpointing_ignored,
    "async-save-waits": _async_save_waits,
    "schedule-one-step-late": _schedule_one_step_late,
    "grad-sync-ignored": _grad_sync_ignored,
    "all-reduce-uncounted": _all_reduce_uncounted,
    "step-groups-ignored": _step_groups_ignored,
}


def _mutant(value=None):  # noqa: ANN001, ANN202 - what a source mutant's replacement calls where it runs
    _applied_once()
    return value


def _source(module: str, old: str, new: str) -> None:
    """Our ``module`` loaded from its source file with ``old`` (which must occur exactly once) replaced by ``new``."""

    def patch(spec, loader):  # noqa: ANN001, ANN202
        source = open(spec.origin).read()
        # the code moved: nothing applied, which tests/mutants.py reports
        if source.count(old) != 1:
            return None
        return compile(source.replace(old, new), spec.origin, "exec")

    if module.endswith(".py"):
        return _script_source(module, patch)
    _on_import(name=module, patch=None, compile_with=patch)


def _script_source(path: str, compile_with) -> None:  # noqa: ANN001
    """A script (``path`` from the repository root: scripts/x.py) changed where a test loads it from its file
    (tests.conftest.run_script, which runs its ``main`` in the test process); one launched as a process of its
    own runs unchanged."""
    import importlib.abc
    import importlib.util
    from pathlib import Path

    original = importlib.util.spec_from_file_location

    def spec_from_file_location(name, location=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        spec = original(name, location, *args, **kwargs)
        ours = spec is not None and Path(str(location)).as_posix().endswith("/" + path)
        code = compile_with(spec, spec.loader) if ours else None
        if code is not None:

            class Loader(importlib.abc.Loader):
                def exec_module(self, module):  # noqa: ANN001
                    module.__dict__["__mutant__"] = _mutant
                    exec(code, module.__dict__)

            spec.loader = Loader()
        return spec

    importlib.util.spec_from_file_location = spec_from_file_location


def _source_table() -> dict:
    """SOURCE from source_mutants.py beside this file, loaded by its path (a process may load this file
    by path too: tests/fake_gpu/sitecustomize.py, where this folder need not be on sys.path)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "source_mutants.py")
    spec = importlib.util.spec_from_file_location("_source_mutants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SOURCE


if _NAME == "source":
    import json

    _spec = json.loads(os.environ["FSDP_ZERO_MUTANT_SOURCE"])
    _source(_spec["module"], _spec["old"], _spec["new"])
elif _NAME:
    _table = _source_table()
    if _NAME in _table:
        _source(*_table[_NAME])
    else:
        MUTANTS[_NAME]()
