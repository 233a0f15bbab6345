"""The source mutants' table (tests/mutant_site/sitecustomize.py applies them; tests/mutants.py runs them).

Each names one exact expression of our source (it must occur exactly once: tests/test_layout.py's
test_every_source_mutant_still_finds_the_expression_it_replaces checks) and its wrong replacement,
which calls ``__mutant__()`` where the changed code runs.
"""

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
        "            return round(bytes_at_b * zero1[2] / zero1[1])",
        "            return __mutant__(line(bytes_at_a, bytes_at_b))",
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
        "return [(s, _cut_stage(copy.deepcopy(model), s, total)) for s in stage_ids(cfg, pp_rank)]",
        "return [(s, __mutant__(copy.deepcopy(model))) for s in stage_ids(cfg, pp_rank)]",
    ),
    "hybrid-data-group-one-dim": (
        "fsdp_zero.distributed.topology",
        "self.mesh[_dim_name(self._mesh_axes(role))]",
        "self.mesh[_dim_name(__mutant__(self._mesh_axes(role)[-1:]))]",
    ),
    "pp-norm-per-stage": (
        "fsdp_zero.training.step",
        "grad_norm = _grad_norm_(groups, self.norm_group)",
        "grad_norm = _grad_norm_(groups, __mutant__(None))",
    ),
    "pp-holds-every-micro-batch": (
        "fsdp_zero.sharding.pipeline",
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
        "for a in reversed(self.sizes) if a not in DATA_AXES + batch",
        'for a in reversed(self.sizes) if a not in (*DATA_AXES, *batch, __mutant__("pp"))',
    ),
    "layout-pp-held-no-gradients": (
        "fsdp_zero.sharding.pipeline",
        "per_rank * (precision.compute.itemsize + precision.reduce.itemsize)",
        "per_rank * (precision.compute.itemsize + __mutant__(0))",
    ),
    "layout-p2p-one-way": (
        "fsdp_zero.sharding.pipeline",
        "return 2 * micro * (boundary or 0)",
        "return __mutant__(1) * micro * (boundary or 0)",
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
        "fsdp_zero.checkpoint.parts",
        "get_model_state_dict(self.model).items() if k not in self.rebuilt}",
        "get_model_state_dict(self.model).items() if k not in __mutant__(())}",
    ),
    "nf4-base-unchecked": (
        "fsdp_zero.training.trainer",
        "check_rebuilt_base(base, state, decision.resume)",
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
        "fsdp_zero.sharding.quantize",
        "precompute_float8_scales(model)  # the loaded weights', not the last step's",
        "__mutant__()  # the loaded weights', not the last step's",
    ),
    "float8-gathered-at-bf16": (
        "fsdp_zero.sharding.quantize",
        "return dict(self.weights) if self.all_gather else {}",
        "return __mutant__({})",
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
    "refusal-rows-after-the-first-skipped": (
        "fsdp_zero.config.rules",
        "    for row in REFUSALS:\n        if (when is None",
        "    for row in __mutant__(REFUSALS[:1]):\n        if (when is None",
    ),
    "field-constraint-unchecked": (
        "fsdp_zero.config.constraints",
        "if rule is not None and not rule.holds(value):",
        "if rule is not None and not rule.holds(value) and __mutant__(False):",
    ),
    "grid-joins-ignored": (
        "fsdp_zero.distributed.topology",
        "a in data or a in joined",
        "a in data or (a in joined and __mutant__(False))",
    ),
    # issue 45: optimizer states off the device
    "offload-group-never-written-back": (
        "fsdp_zero.sharding.offload",
        "self._last = self._submit(self.store.write, g, buf)",
        "self._last = __mutant__(None)",
    ),
    "offload-prefetch-wrong-group": (
        "fsdp_zero.sharding.offload",
        "inflight.append((nxt, buf, self._submit(self.store.read, nxt, buf)))",
        "inflight.append((nxt, buf, self._submit(self.store.read, __mutant__(g), buf)))",
    ),
    "offload-ratio-ignored": (
        "fsdp_zero.sharding.offload",
        "first = offloaded_from(len(cut), ratio)",
        "first = offloaded_from(len(cut), __mutant__(1.0))",
    ),
    "ds-nvme-offload-in-memory": (
        "fsdp_zero.config.deepspeed",
        '"nvme": StateTier.disk.value',
        '"nvme": __mutant__(StateTier.cpu.value)',
    ),
    "step-reads-the-loss": (
        "fsdp_zero.training.step",
        "learns = trained != 0",
        "learns = trained != 0 and __mutant__(math.isfinite(loss.item()) or True)",
    ),
    "gate-read-before-fused-adamw": (
        "fsdp_zero.training.step",
        "early = bool(agreed and learns and not self.scaler and skips_on_device(self.optimizer))",
        "early = __mutant__(False)",
    ),
    "fused-skip-ignored": (
        "fsdp_zero.torch_private",
        "optimizer.found_inf = found_inf",
        "optimizer.found_inf = __mutant__(torch.zeros_like(found_inf))",
    ),
    "trace-steps-in-throughput": (
        "fsdp_zero.training.steplog",
        "self._interval_steps += 0 if self._traced else 1",
        "self._interval_steps += __mutant__(1)",
    ),
    "trace-runs-split": (
        "fsdp_zero.monitor.trace",
        "if runs and step == runs[-1][1] + 1:",
        "if runs and step == __mutant__(runs[-1][1]):",
    ),
    "rope-cast-to-compute": (
        "fsdp_zero.model.transformer",
        "cos, sin = table.real, table.imag",
        "cos, sin = __mutant__(table.real).to(x.dtype), table.imag.to(x.dtype)",
    ),
    "cast-finder-blind": (
        "fsdp_zero.monitor.casts",
        "if cast.before != cast.after and cast not in found:",
        "if __mutant__(False):",
    ),
    "last-unit-resharded": (
        "fsdp_zero.sharding.parallelize",
        'kept = {"reshard_after_forward": False} if fqn == last else {}',
        "kept = __mutant__({})",
    ),
    "data-prefetch-never-started": (
        "fsdp_zero.data.loader",
        "self._ahead = self._fetcher.submit(next, self._batches)",
        "self._ahead = __mutant__(None)",
    ),
    "data-prefetch-kept-after-seek": (
        "fsdp_zero.data.loader",
        "self._position, self._batches, self._ahead = value, None, None",
        "self._position, self._batches, self._ahead = value, None, __mutant__(self._ahead)",
    ),
    "ds-no-scheduler-ours": (
        "fsdp_zero.config.deepspeed",
        'constant = _SCHEDULER.overrides(_SCHEDULES["WarmupLR"]) + _WARMUP.overrides(0)',
        "constant = __mutant__([])",
    ),
    # issue 47: long sequences
    "sp-all-to-all-wrong-dim": (
        "fsdp_zero.sharding.sequence",
        "return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)",
        "return __mutant__(got.permute(1, 2, 3, 0, 4)).reshape(b, h // sp, sp * s, d)",
    ),
    "sp-positions-restart": (
        "fsdp_zero.sharding.sequence",
        "start = self.rank * s",
        "start = __mutant__(0) * s",
    ),
    "sp-loss-per-rank": (
        "fsdp_zero.training.trainer",
        "data_group=parts.built.topology.group(Role.LOSS),",
        "data_group=parts.built.topology.group(__mutant__(Role.BATCH)),",
    ),
    "sp-all-to-all-uncounted": (
        "fsdp_zero.sharding.sequence",
        "count.add(x, dist.get_world_size(group))",
        "__mutant__(None)",
    ),
    "tiled-loss-logits-kept": (
        "fsdp_zero.model.tasks",
        "recomputed(hidden[i : i + chunk]",
        "__mutant__(_chunk_loss)(hidden[i : i + chunk]",
    ),
    "tiled-loss-chunk-dropped": (
        "fsdp_zero.model.tasks",
        "torch.stack(sums).sum()",
        "torch.stack(__mutant__(sums[:-1])).sum()",
    ),
    "act-offload-no-copy": (
        "fsdp_zero.sharding.act_offload",
        'return _Packed(torch.empty_like(source, device="cpu").copy_(source), tensor.device)',
        "return __mutant__(tensor)",
    ),
    "act-offload-hook-not-first": (
        "fsdp_zero.sharding.act_offload",
        "block.register_forward_pre_hook(self._enter, prepend=True)",
        "block.register_forward_pre_hook(self._enter, prepend=__mutant__(False))",
    ),
    "act-offload-in-recompute": (
        "fsdp_zero.sharding.act_offload",
        "if torch.is_grad_enabled() and not recomputing(block):",
        "if torch.is_grad_enabled() and not __mutant__(False):",
    ),
    "sp-eval-unsliced": (
        "fsdp_zero.training.evaluate",
        "if self.seq_part[1] > 1:",
        "if __mutant__(False):",
    ),
    "ep-combine-misrouted": (
        "fsdp_zero.sharding.experts",
        "return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))",
        "return torch.zeros_like(x).index_add_(0, __mutant__(tokens.flip(0)), weighted.to(x.dtype))",
    ),
    "ep-aux-dropped": (
        "fsdp_zero.model.tasks",
        'loss = loss + moe["router_aux_loss_coef"] * aux * weight',
        "loss = loss + __mutant__(0) * aux * weight",
    ),
    "ep-norm-per-rank": (
        "fsdp_zero.training.step",
        'norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)',
        "norms.append(__mutant__((lambda t: (dist.all_reduce(q := t.to_local().float().square()), "
        'q.sqrt())[1])(norm)) if hasattr(norm, "full_tensor") else norm)',
    ),
    "ep-grads-undivided": (
        "fsdp_zero.sharding.experts",
        "unit.set_gradient_divide_factor(float(self.divide))",
        "__mutant__(None)",
    ),
}
