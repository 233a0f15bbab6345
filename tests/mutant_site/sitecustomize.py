"""A wrong behaviour injected into every Python process of a test run (tests/mutants.py).

On the PYTHONPATH with FSDP_ZERO_MUTANT=<name>, Python imports this at start-up in the test
process and in every process a test launches (torchrun's agent, its ranks, plain runs). Each
mutant wraps a public torch API (or one function of ours) so that a setting is silently ignored
or done wrongly, as a bug would, and writes a line to $FSDP_ZERO_MUTANT_LOG the first time it
changes something, so tests/mutants.py can tell a mutant the suite caught from one that never ran.
Without FSDP_ZERO_MUTANT nothing happens.

Where no public API carries the lever (an expression inside one of our functions), a mutant is a
source edit: our module is loaded from its own file with one exact piece of text replaced (`SOURCE`;
the text must occur exactly once, or nothing is applied). The replacement calls ``__mutant__()``
where the changed code runs, so "applied" means the wrong code ran, not merely that it was loaded.
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
        original = module._step_groups

        def _step_groups(params, size):  # noqa: ANN001
            if size and len(original(params, size)) > 1:
                _applied_once()
            return original(params, 0)

        module._step_groups = _step_groups

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


# name: (our module, or a script's path run in the test process, the exact text, its wrong replacement);
# tests/mutants.py says what each is and what catches it.
SOURCE = {
    "ds-optimizer-defaults-ours": (
        "fsdp_zero.config.deepspeed",
        "if rule.ds not in ds.flat",
        "if __mutant__(False)",
    ),
    "wrap-repeats-unseen": (
        "fsdp_zero.sharding.wrap",
        "found = _repeated_classes(model)",
        "found = __mutant__([])",
    ),
    "end-line-rank0-only": (
        "fsdp_zero.distributed.env",
        'path = os.environ.get("TORCHELASTIC_ERROR_FILE")',
        "path = __mutant__(None)",
    ),
    "masked-grad-unweighted": (
        "fsdp_zero.training.step",
        "scaled = loss * weight if weight is not None else loss / len(micro_batches)",
        "scaled = (loss if weight is None else __mutant__(loss)) / len(micro_batches)",
    ),
    "val-mask-in-train": (
        "fsdp_zero.data.prepare",
        "masks[split].write(mask.tobytes())",
        'masks["train" if split == "train" else __mutant__("train")].write(mask.tobytes())',
    ),
    "chat-eos-always-trained": (
        "fsdp_zero.data.prepare",
        'mask + [int(messages[-1]["role"] == "assistant")]',
        'mask + [1 if messages[-1]["role"] == "assistant" else __mutant__(1)]',
    ),
    "table-row-groups-reversed": (
        "fsdp_zero.data.tables",
        "batch_size=BATCH, columns=names, use_threads=False",
        "batch_size=BATCH, columns=names, use_threads=False, "
        "row_groups=__mutant__(range(source.num_row_groups - 1, -1, -1))",
    ),
    "table-column-flags-ignored": (
        "fsdp_zero.data.documents",
        "    names = [fields] if isinstance(fields, str) else list(fields)\n    table = open_table(path)",
        '    fields = __mutant__({"text": "text", "prompt_completion": ("prompt", "completion")}'
        '.get(fmt, "messages"))\n'
        "    names = [fields] if isinstance(fields, str) else list(fields)\n    table = open_table(path)",
    ),
    "table-read-whole": (
        "fsdp_zero.data.tables",
        "lambda names: source.iter_batches(",
        "lambda names: __mutant__(lambda **_: iter(source.read(columns=names).to_batches(BATCH)))(",
    ),
    "lora-a-bound-out": (
        "fsdp_zero.model.lora",
        "bound=1 / math.sqrt(m.in_features)",
        "bound=1 / math.sqrt(__mutant__(m.out_features))",
    ),
    "lora-dropout-ignored": (
        "fsdp_zero.model.lora",
        "nn.Dropout(dropout) if dropout > 0 else nn.Identity()",
        "__mutant__(nn.Identity()) if dropout > 0 else nn.Identity()",
    ),
    "lora-scaling-alpha": (
        "fsdp_zero.model.lora",
        "self.scaling = alpha / rank",
        "self.scaling = __mutant__(alpha)",
    ),
    "adapters-only-drops-lora-train": (
        "fsdp_zero.model.lora",
        "if adapters_only and lora.train:",
        "if adapters_only and lora.train and __mutant__(False):",
    ),
    "freeze-prefix-match": (
        "fsdp_zero.model.lora",
        "found = {n for n in names if re.fullmatch(pattern, n)}",
        "found = {n for n in names if __mutant__(re.match(pattern, n))}",
    ),
    "comm-seconds-replicas": (
        "fsdp_zero.monitor.comm",
        "replicas = topology.replicas if fsdp else world_size",
        "replicas = __mutant__(world_size // shard)",
    ),
    "fit-fp32-as-fast": (
        "fsdp_zero.tools.fit",
        "slow = rates.fp32_speed if precision.compute == torch.float32 else 1.0",
        "slow = 1.0 if precision.compute != torch.float32 else __mutant__(1.0)",
    ),
    "fit-offload-peak-kept": (
        "fsdp_zero.tools.fit",
        "peak -= s.model_state * (1 + CUDA_ALLOCATOR_SLACK)",
        "peak -= __mutant__(0)",
    ),
    "fit-offload-copies-free": (
        "fsdp_zero.tools.fit",
        "offload = (gathers + reductions) * shard * 8 / (rates.host_gbps * 1e9)",
        "offload = __mutant__(0.0)",
    ),
    "fit-ties-unbroken": (
        "fsdp_zero.tools.fit",
        "scored.sort(key=lambda s: (s.cost, s.peak))",
        "scored.sort(key=lambda s: __mutant__(s.cost))",
    ),
    "fit-probe-dtype-ignored": (
        "fsdp_zero.tools.fit",
        'fixed, block, forward = m.compute[str(precision.compute).removeprefix("torch.")]',
        'fixed, block, forward = m.compute[__mutant__("float32")]',
    ),
    "fit-micro-batch-not-freed": (
        "fsdp_zero.tools.candidates",
        'return ["train.micro_batch_size=1"] if "micro_batch" in search else []',
        'return [] if "micro_batch" not in search else __mutant__([])',
    ),
    "fit-slow-dtype-run": (
        "fsdp_zero.tools.rates",
        'if name != "float32" and ratio > _SLOW_DTYPE:',
        'if name != "float32" and ratio > _SLOW_DTYPE and __mutant__(False):',
    ),
    "pretrained-kwargs-dropped": (
        "fsdp_zero.model.hf",
        "config = {**json.loads((source / CONFIG_FILE).read_text()), **kwargs}",
        "config = {**json.loads((source / CONFIG_FILE).read_text()), **__mutant__({})}",
    ),
    "deferral-not-restored": (
        "fsdp_zero.training.step",
        "# left on whatever happened: a later step (or evaluation) must reduce as usual\n            if defer:",
        "# left on whatever happened: a later step (or evaluation) must reduce as usual\n"
        "            if defer and __mutant__(False):",
    ),
    "compose-one-peak": (
        "fsdp_zero.tools.depth",
        "tensors, heap_at_peak = max(regions.values(), key=lambda part: sum(part[0].values()))",
        "tensors, heap_at_peak = __mutant__(regions[max(b.regions, key=lambda r: sum(b.regions[r][0].values()))])",
    ),
    "compose-zero1-evenly": (
        "fsdp_zero.tools.depth",
        "return round(bytes_at_b * zero1[2] / zero1[1]) if zero1 else line(bytes_at_a, bytes_at_b)",
        "return line(bytes_at_a, bytes_at_b) if not zero1 else __mutant__(line(bytes_at_a, bytes_at_b))",
    ),
    "planner-simulates-on-the-target": (
        "fsdp_zero.tools.planner",
        'self.device = torch.device("cpu")',
        "self.device = __mutant__(self.target)",
    ),
    "tp-plan-skipped": (
        "fsdp_zero.sharding.tensor",
        "    parallelize_module(\n        model,",
        "    (parallelize_module if __mutant__(False) else lambda *args: None)(\n        model,",
    ),
    "loss-parallel-ignored": (
        "fsdp_zero.sharding.tensor",
        "_style(model.get_submodule(fqn), style, sequence_parallel, loss_parallel)",
        "_style(model.get_submodule(fqn), style, sequence_parallel, __mutant__(False))",
    ),
    "same-batch-unchecked": (
        "fsdp_zero.data.loader",
        "        for group in self._same_as:",
        "        for group in self._same_as if __mutant__(False) else ():",
    ),
    "tp-collectives-uncounted": (
        "fsdp_zero.monitor.comm",
        "count_functional_collectives(self._add_tp) if tp else",
        "count_functional_collectives(self._add_tp) if tp and __mutant__(False) else",
    ),
    "tokens-over-world": (
        "fsdp_zero.training.step",
        "dist.all_reduce(total, group=group)",
        "dist.all_reduce(total, group=__mutant__(None))",
    ),
    "stage-built-whole": (
        "fsdp_zero.sharding.pipeline",
        "return [(s, _cut_stage(copy.deepcopy(model), s, num_stages)) for s in ids]",
        "return [(s, __mutant__(copy.deepcopy(model))) for s in ids]",
    ),
    "hybrid-data-group-one-dim": (
        "fsdp_zero.distributed.topology",
        'self.fixed_mesh["dp" if self.spec.hybrid else "dp_shard"]',
        'self.fixed_mesh["dp_shard" if __mutant__(True) else "dp"]',
    ),
    "pp-norm-per-stage": (
        "fsdp_zero.training.step",
        "grad_norm = _grad_norm_(groups, self.pipeline.stages.group if self.pipeline else None)",
        "grad_norm = _grad_norm_(groups, self.pipeline.stages.group if __mutant__(False) else None)",
    ),
    "pp-holds-every-micro-batch": (
        "fsdp_zero.tools.layout",
        'in_flight = micro if schedule == "GPipe" else min(micro, pp - pp_rank)',
        "in_flight = micro if __mutant__(True) else min(micro, pp - pp_rank)",
    ),
    "layout-keeps-twin-activations": (
        "fsdp_zero.tools.layered",
        "activations = terms.activations * row.activations / at_twin",
        "activations = __mutant__(terms.activations)",
    ),
    "tp-plan-index-one-digit": (
        "fsdp_zero.sharding.tensor",
        'replace(r"\\*", r"[^.]+")',
        'replace(r"\\*", __mutant__(r"\\d"))',
    ),
    "pp-remainder-layers-dropped": (
        "fsdp_zero.sharding.pipeline",
        "stop = start + per + (1 if s < extra else 0)",
        "stop = start + per + (1 if s < extra and __mutant__(False) else 0)",
    ),
    "tp-norm-first-mesh-only": (
        "fsdp_zero.training.step",
        "    return torch.stack([n.float() for n in norms]).square().sum().sqrt()",
        "    return __mutant__(norms[0])",
    ),
    "pp-same-batch-unchecked": (
        "fsdp_zero.distributed.topology",
        "(self.tp_group(), self.pp_group())",
        "(self.tp_group(), None if self.pp == 1 else __mutant__(None))",
    ),
    "layout-pp-held-no-gradients": (
        "fsdp_zero.tools.layout",
        "per_rank * (precision.compute.itemsize + precision.reduce.itemsize)",
        "per_rank * (precision.compute.itemsize + __mutant__(0))",
    ),
    "layout-p2p-one-way": (
        "fsdp_zero.tools.layered",
        "sends = 2 * micro * (row.boundary or 0)",
        "sends = __mutant__(1) * micro * (row.boundary or 0)",
    ),
    "layout-tp-gathered-whole": (
        "fsdp_zero.tools.layered",
        "else terms.gathered * row.per_rank / row.params",
        "else __mutant__(terms.gathered)",
    ),
    "compose-host-state-shallow": (
        "fsdp_zero.tools.depth",
        "host_state=model_state if b.host_state else 0,",
        "host_state=__mutant__(b.host_state) if b.host_state else 0,",
    ),
    "rates-block-slope-off-by-one": (
        "fsdp_zero.tools.rates",
        "max((td - t1) / (deep - 1), 0.0)",
        "max((td - t1) / __mutant__(deep), 0.0)",
    ),
    "nf4-per-shard": (
        "fsdp_zero.sharding.quantize",
        "nf4 = to_nf4(whole, self.block, self.scaler_block)",
        "nf4 = to_nf4(__mutant__(torch.cat([to_nf4(c, self.block, self.scaler_block)"
        ".get_original_weight() for c in whole.chunk(2)])), self.block, self.scaler_block)",
    ),
    "nf4-base-checkpointed": (
        "fsdp_zero.checkpoint.dcp",
        "model_sd = {k: v for k, v in get_model_state_dict(model).items() if k not in rebuilt}",
        "model_sd = {k: v for k, v in get_model_state_dict(model).items() if k not in __mutant__(())}",
    ),
    "nf4-base-unchecked": (
        "fsdp_zero.training.trainer",
        "check_rebuilt_base(built.nf4, state, decision.resume)",
        "__mutant__()",
    ),
    "nf4-counted-as-stored": (
        "fsdp_zero.sharding.parallelize",
        "counts = (num_params - q, num_params - frozen, num_params - frozen)",
        "counts = (num_params - __mutant__(0), num_params - frozen, num_params - frozen)",
    ),
    "low-bit-lr-frozen": (
        "fsdp_zero.training.step",
        'group["lr"].fill_(lr)',
        "__mutant__()",
    ),
    "low-bit-states-ignored": (
        "fsdp_zero.sharding.optim",
        "if cfg.state_bits != 32:  # (config.rules refuses zero1 and step groups with it)",
        "if cfg.state_bits != __mutant__(cfg.state_bits):",
    ),
    "low-bit-bytes-as-fp32": (
        "fsdp_zero.sharding.quantize",
        "return 2 * (numel * bits / 8 + 4 * numel / block + 4 * 2**bits)",
        "return __mutant__(8 * numel)",
    ),
    "float8-ignored": (
        "fsdp_zero.sharding.quantize",
        "convert_float8(model, linears, recipe, emulate)",
        "__mutant__()",
    ),
    "float8-stale-scales-after-load": (
        "fsdp_zero.sharding.build",
        "precompute_float8_scales(self.model)",
        "__mutant__()",
    ),
    "float8-gathered-at-bf16": (
        "fsdp_zero.sharding.build",
        "out.update(self.float8.weights)",
        "__mutant__()",
    ),
    "float8-bytes-unviewed": (
        "fsdp_zero.sharding.parallelize",
        "out, inp = out.view(torch.uint8), inp.view(torch.uint8)",
        "__mutant__()",
    ),
    "test-process-sees-gpus": (
        "tests.cpu_only",
        'os.environ["CUDA_VISIBLE_DEVICES"] = ""',
        "__mutant__()",
    ),
    "ds-zero3-floor": (
        "fsdp_zero.checkpoint.deepspeed_in",
        "part = math.ceil(numel / n)",
        "part = __mutant__(numel // n)",
    ),
    "ds-schedule-unlagged": (
        "fsdp_zero.training.step",
        "i, warmup, start = step - 1, max(2, cfg.warmup_steps), cfg.warmup_start_ratio",
        "i, warmup, start = __mutant__(step), max(2, cfg.warmup_steps), cfg.warmup_start_ratio",
    ),
    "ds-samples-dropped": (
        "fsdp_zero.checkpoint.deepspeed_in",
        'int(meta.get("global_samples") or 0),',
        "__mutant__(0),",
    ),
    "ds-moments-swapped": (
        "fsdp_zero.checkpoint.deepspeed_in",
        '_MOMENTS = ("exp_avg", "exp_avg_sq")\n',
        '_MOMENTS = ("exp_avg_sq", "exp_avg")\n__mutant__(0)\n',
    ),
    "ds-unpickle-anything": (
        "fsdp_zero.checkpoint.deepspeed_in",
        'map_location="cpu", weights_only=True, mmap=True',
        'map_location="cpu", weights_only=__mutant__(False), mmap=True',
    ),
    "nf4-block-size-ignored": (
        "fsdp_zero.sharding.quantize",
        "nf4 = to_nf4(whole, self.block, self.scaler_block)",
        "nf4 = to_nf4(whole, 64 if self.block == 64 else __mutant__(64), self.scaler_block)",
    ),
    "nf4-resume-checks-source-path": (
        "fsdp_zero.checkpoint.weights",
        'if saved.get("digest") != nf4.digest:',
        'if saved.get("source") != __mutant__(nf4.source):',
    ),
    "lowbit-eps-ignored": (
        "fsdp_zero.sharding.optim",
        "eps=cfg.eps)",
        "eps=cfg.eps if cfg.eps == 1e-8 else __mutant__(1e-8))",
    ),
    "lowbit-partial-blocks-counted": (
        "fsdp_zero.sharding.quantize",
        "numel < _STATE_MIN_NUMEL or numel % block:",
        "numel < _STATE_MIN_NUMEL or (numel % block and __mutant__(False)):",
    ),
    "float8-rowwise-counted-as-float8-gather": (
        "fsdp_zero.sharding.quantize",
        'Float8Plan(recipe, emulate, recipe == "tensorwise", weights)',
        'Float8Plan(recipe, emulate, recipe == "tensorwise" or __mutant__(True), weights)',
    ),
    "ds-ranks-sorted-as-text": (
        "fsdp_zero.checkpoint.deepspeed_in",
        "return [found[r] for r in range(len(found))]",
        "return __mutant__(sorted(found.values()))",
    ),
    "ds-import-ignores-deepspeed-flag": (
        "scripts/import_deepspeed.py",
        "read_deepspeed(args.deepspeed or ckpt.ds_config,",
        "read_deepspeed(ckpt.ds_config if not args.deepspeed else __mutant__(ckpt.ds_config),",
    ),
    "table-struct-nulls-kept": (
        "fsdp_zero.data.tables",
        "{k: v for k, v in item.items() if v is not None}",
        "{k: v for k, v in item.items() if v is not None or __mutant__(True)}",
    ),
    "decay-1d-ignored": (
        "fsdp_zero.sharding.optim",
        "decay_1d = cfg.weight_decay if cfg.decay_1d else 0.0",
        "decay_1d = cfg.weight_decay if cfg.decay_1d and __mutant__(False) else 0.0",
    ),
    "ds-adam-step-from-global-steps": (
        "fsdp_zero.checkpoint.deepspeed_in",
        'adam_step=float(moments.get("step", ckpt.step)),',
        "adam_step=float(__mutant__(ckpt.step)),",
    ),
}

if _NAME == "source":
    import json

    _spec = json.loads(os.environ["FSDP_ZERO_MUTANT_SOURCE"])
    _source(_spec["module"], _spec["old"], _spec["new"])
elif _NAME in SOURCE:
    _source(*SOURCE[_NAME])
elif _NAME:
    MUTANTS[_NAME]()
