"""The mutants tests/mutants.py runs: what each breaks, where its catchers are, which tests must fail.
A behaviour mutant (a public API wrapped) is tests/mutant_site/sitecustomize.py's; a source mutant (one
expression of ours replaced) is tests/mutant_site/source_mutants.py's. Each has a row here."""


def _only(file: str, test: str) -> tuple[list[str], list[str]]:
    """A row's catcher: the one test ``test`` of ``file`` (a path, or X for tests/test_X.py), run
    alone and required to fail."""
    file = file if "/" in file else f"tests/test_{file}.py"
    return [f"{file}::{test}"], [test]


# The tests that catch the source mutants below without a training run (their pytest node ids' last part).
_DS_DEFAULTS = "test_the_optimizer_settings_a_ds_config_leaves_out_are_deepspeeds_defaults"
_REFUSAL_ROWS = "test_each_refusal_refuses_its_example_alone_in_one_line"
_FIELD_BOUND = "test_bad_input_names_the_key_and_the_choices"
_GRID_JOINS = "test_a_declared_axis_joins_the_grid_its_roles_and_its_errors"
_REPEATED = "test_a_model_that_declares_no_block_wraps_the_class_its_outermost_list_repeats"
_END_LINE = "test_a_bad_setting_shows_its_line_under_torchrun_whichever_rank_exits_first"
_SPLITS = "test_each_split_has_its_own_mask_and_the_val_split_trains_on_its_completions"
_EOS = "test_the_final_eos_is_trained_only_after_an_assistant_turn"
_INIT = "test_init_adapters_draws_a_within_one_over_sqrt_in_and_zeroes_b"
_DROPOUT = "test_lora_dropout_masks_only_the_adapter_input_and_only_in_training"
_SUM = "test_lora_linear_adds_alpha_over_rank_times_b_a_x_by_hand"
_ADAPTERS = "test_adapters_only_refusals_exit_2_in_one_line_and_write_nothing"
_FULL = "test_freeze_and_train_patterns_match_whole_names_on_twelve_layers"
_CUDA = "test_on_cuda_fp32_computes_15_times_slower_and_offload_trades_device_memory_for_copies"
_TIES = "test_equal_costs_go_to_the_smaller_peak"
_MEASURED = "test_a_measured_cost_is_the_probes_seconds_by_hand"
_MICRO = "test_a_global_batch_the_default_micro_batch_does_not_divide_is_searched"
_SLOW = "test_the_probe_scales_a_slow_dtype_from_fp32_instead_of_running_it"
_KWARGS = "test_a_pretrained_runs_export_applies_its_model_kwargs_over_the_folders_config"
_DEFER = "test_a_micro_batch_that_raises_leaves_the_reduction_on"
_COMPOSED = "test_a_composed_prediction_equals_the_whole_models_simulation"
_GPU_HOST = "test_the_suites_own_process_leaves_cuda_alone_on_a_gpu_host"
_TRACE_RATE = "test_the_throughput_of_an_interval_counts_its_untraced_steps_only"
_TRACE_RUNS = "test_consecutive_steps_share_a_trace"
_AHEAD = "test_the_next_batch_is_made_in_the_cursors_thread_before_it_is_asked_for"
_SEEK = "test_a_seek_drops_the_batch_fetched_ahead_and_reads_what_a_fresh_cursor_reads"
_ONE_READ = "test_a_step_reads_the_host_once_in_its_gate_and_fused_adamw_is_launched_before"
_SKIP_ON_DEVICE = "test_fused_adamw_skips_a_non_finite_step_on_the_device"
_GPU_PLAN = "test_planner_plans_for_gpus_from_a_machine_without_one"
_LOSS_PARALLEL = "test_loss_parallel_keeps_the_logits_split_over_the_vocabulary"
_SAME_BATCH = "test_a_tensor_parallel_group_reading_different_batches_is_refused"
_TP_COMM = "test_tensor_parallel_fsdp_moves_a_tp_ranks_part_of_each_unit"
_TP_STATE = "test_model_state_per_rank_follows_the_tensor_parallel_formula"
_TP_TOKENS = "test_tp_pp_and_sp_count_the_trained_tokens_over_the_loss_ranks"
_PP_STAGES = "test_each_pipeline_stage_holds_its_own_layers_under_their_full_names"
_PARITY = "test_losses_grad_norms_and_learning_rates_match_single_process"
_SPLIT_EVAL = "test_pipeline_validation_matches_zero3"
_PP_HELD = "test_a_layouts_activations_are_what_its_schedule_holds_of_what_each_stage_saves"
_LAYOUT_FIT = "test_a_layout_search_composes_each_layout_from_zero3_by_formula"
_TIERED = "test_groups_step_where_they_live_with_the_in_memory_bits"
_DS_OFFLOAD = "test_deepspeeds_offloads_map_onto_offload_states_and_cpu_offload"
_NF4_WHOLE = "test_the_base_is_nf4_on_every_rank_quantized_whole_and_never_changes"
_NF4_RESUME = "test_resume_rebuilds_the_base_and_continues_exactly"
_LOW_BIT = "test_states_are_low_bit_where_a_shard_is_whole_blocks_and_train_like_adamw"
_FP8_LINEARS = "test_the_block_linears_compute_in_float8_and_train_as_bf16_does"
_FP8_RESUME = "test_a_resume_continues_exactly"
_FP8_GATHER = "test_tensorwise_all_gathers_its_weights_in_float8"
_FP8_BYTES = "test_a_unit_of_float8_weights_is_gathered_as_bytes_on_gloo"
_TABLES = "test_every_table_kind_gives_the_jsonl_bytes_at_one_and_two_workers"
_TABLE_MEMORY = "test_memory_does_not_grow_with_the_parquet_file"
_DS_BITS = "test_the_import_holds_deepspeeds_weights_moments_and_position_bit_for_bit"
_DS_LR = "test_deepspeeds_schedule_is_followed_step_for_step"
_DS_CONTINUED = "test_a_continued_run_takes_deepspeeds_next_steps"
_DS_DAMAGED = "test_a_damaged_checkpoint_is_one_line_and_nothing_is_written"
_TP_TWELVE = "test_the_tensor_parallel_plan_reaches_every_layer_of_twelve"
_FOREIGN = "test_foreign_model_trains_like_single_process"
_SAME_GROUPS = "test_the_same_batch_groups_are_a_ranks_tensor_parallel_pair_and_its_pipeline"
_LAYOUT_PEAK = "test_a_layout_peak_holds_a_tp_ranks_part_and_a_stage_with_its_gradients"
_PROBE_SLOPE = "test_the_probe_takes_a_blocks_seconds_as_the_slope_between_its_two_cuts"
_NF4_BLOCK = "test_the_nf4_block_size_reaches_the_quantizer"
_NF4_DIGEST = "test_a_resume_checks_the_rebuilt_bases_digest_not_its_path"
_LOW_BIT_SETTINGS = "test_adamws_settings_reach_the_low_bit_optimizer"
_LOW_BIT_BYTES = "test_the_state_bytes_are_torchaos_tensor_by_tensor"
_FP8_WHICH = "test_only_tensorwise_weights_are_all_gathered_in_float8"
_DS_RANKS = "test_rank_files_are_taken_in_numeric_rank_order"
_DS_FLAG = "test_the_deepspeed_flag_gives_the_settings_over_the_checkpoints_own"
_TABLE_FIELDS = "test_a_chat_messages_fields_are_only_its_own"
_DS_ADAM_STEP = "test_adamws_step_is_the_optimizers_not_deepspeeds_global_step"

# name: (the wrong behaviour, the test files (or node ids) to run, the tests (function names) that must catch it)
_SEQ = "tests/test_sequence.py"
_SP_BYTES = "test_each_layer_sends_4_slice_h_b_over_sp_and_attention_gathers_nothing"
_SP_EVAL = ([f"tests/test_parity.py::{_SPLIT_EVAL}[sp2]"], [_SPLIT_EVAL])
_SP2_PARITY = ([f"tests/test_parity.py::{_PARITY}[sp2]"], [_PARITY])
_OFFLOADED = (
    ["tests/test_act_offload.py"],
    ["test_offload_trains_bit_for_bit_and_counts_the_checkpointed_inputs"],
)
_EP_PARITY = "test_expert_parallel_training_matches_one_process"


def _ep(run: str) -> tuple[list[str], list[str]]:
    return [f"tests/test_experts.py::{_EP_PARITY}[{run}]"], [_EP_PARITY]


MUTANTS = {
    "reduce-in-bf16": (
        "bf16-mixed and fp16-mixed reduce gradients in 16 bits, not fp32",
        *_only("parity", "test_gradients_reach_the_reduction_in_the_reduce_dtype"),
    ),
    "offload-ignored": (
        "parallel.cpu_offload never reaches FSDP2",
        *_only("parity", "test_cpu_offload_policy_reaches_every_unit"),
    ),
    "always-reshard": (
        "reshard_after_forward forced to True on the units: ZeRO-2 and hpZ run as ZeRO-3",
        ["tests/test_parity.py", "tests/test_compare.py"],
        [
            "test_what_stays_gathered_between_forward_and_backward",
            "test_table_orders_the_strategies_by_memory",
        ],
    ),
    "root-resharded": (
        "the root unit freed after forward, gathered again at once for backward",
        *_only("parity", "test_what_stays_gathered_between_forward_and_backward"),
    ),
    "prefetch-ignored": (
        "parallel.prefetch: FSDP2's prefetch lists never set",
        ["tests/test_parity.py"],
        ["test_explicit_prefetch_starts_the_next_units_all_gather_before_a_unit_computes"],
    ),
    "clipping-ignored": (
        "optim.grad_clip: the norm is logged, the gradients never scaled",
        *_only("parity", _PARITY),
    ),
    "checkpointing-ignored": (
        "parallel.activation_checkpointing: no block is recomputed",
        *_only("parity", "test_activation_checkpointing_lowers_the_activation_peak"),
    ),
    "async-save-waits": (
        "checkpoint.async_save: each save written before training goes on",
        ["tests/test_checkpoint.py"],
        ["test_async_save_writes_the_same_checkpoints_while_training_goes_on"],
    ),
    "schedule-one-step-late": (
        "the learning-rate schedule runs one step behind",
        *_only("parity", _PARITY),
    ),
    "grad-sync-ignored": (
        "parallel.grad_sync: FSDP2's deferral switches ignored, every micro-batch reduces",
        *_only("comm", "test_grad_sync_trains_the_same_with_fewer_reductions"),
    ),
    "all-reduce-uncounted": (
        "comm/all_reduce_mib: HSDP's all-reduce never counted",
        *_only("comm", "test_counted_bytes_per_step_equal_the_formula"),
    ),
    "step-groups-ignored": (
        "optim.step_group_size: AdamW steps the whole shard at once",
        ["tests/test_step_group.py"],
        ["test_the_optimizer_steps_temporaries_are_one_groups_not_the_shards"],
    ),
    # Source mutants (source_mutants.py's SOURCE): one expression changed; some catchers node ids
    "ds-optimizer-defaults-ours": (
        "--deepspeed: the optimizer settings a ds_config leaves out take ours (weight decay 0.1, betas 0.95), "
        "not DeepSpeed's",
        *_only("deepspeed", _DS_DEFAULTS),
    ),
    "wrap-repeats-unseen": (
        "the transformer policy: a model that declares no block is refused, the class its ModuleList repeats "
        "never looked for",
        *_only("wrap", _REPEATED),
    ),
    "end-line-rank0-only": (
        "a run's last line (a bad setting's) printed by rank 0 alone: lost when torchrun ends rank 0 first",
        *_only("cli", _END_LINE),
    ),
    "masked-grad-unweighted": (
        "masked data: the backward's loss not token-weighted (the logged loss still is)",
        ["tests/test_masked.py"],
        [
            "test_the_masked_loss_equals_a_hand_computation",
            "test_unclipped_masked_training_matches_the_single_process_loop",
        ],
    ),
    "val-mask-in-train": (
        "prepare_data: the validation split's masks written to train.mask.bin",
        *_only("masked", _SPLITS),
    ),
    "chat-eos-always-trained": (
        "prepare_data: a chat's final EOS trained after a user or system turn too",
        *_only("masked", _EOS),
    ),
    "table-row-groups-reversed": (
        "prepare_data: a Parquet file's row groups read last first",
        *_only("datasets", _TABLES),
    ),
    "table-column-flags-ignored": (
        "prepare_data: --field, --prompt-field and --completion-field ignored for tables (their "
        "default columns read)",
        *_only("datasets", _TABLES),
    ),
    "table-read-whole": (
        "prepare_data: a Parquet file read whole into one Arrow table, not a batch of rows at a time",
        *_only("datasets", _TABLE_MEMORY),
    ),
    "lora-a-bound-out": (
        "LoRA's A drawn within 1/sqrt(out_features), not in_features",
        *_only("lora", _INIT),
    ),
    "lora-dropout-ignored": ("model.lora.dropout never applied", *_only("lora", _DROPOUT)),
    "lora-scaling-alpha": ("LoRA scaled by alpha, not alpha / rank", *_only("lora", _SUM)),
    "adapters-only-drops-lora-train": (
        "export.py --adapters-only of a run that trained model.lora.train not refused",
        *_only("lora", _ADAPTERS),
    ),
    "freeze-prefix-match": (
        "model.freeze and model.lora.train matched as prefixes (re.match)",
        *_only("lora", _FULL),
    ),
    "comm-seconds-replicas": (
        "comm_seconds: DDP's and ZeRO-1's all-reduce over one replica (0 s)",
        ["tests/test_comm.py::test_formula_by_hand"],
        ["test_formula_by_hand"],
    ),
    "fit-fp32-as-fast": ("the fit on CUDA: fp32 computes as fast as bf16", *_only("fit", _CUDA)),
    "fit-offload-peak-kept": (
        "the fit on CUDA: offload's host-resident model state still counted on the device",
        *_only("fit", _CUDA),
    ),
    "fit-offload-copies-free": (
        "the fit on CUDA: offload's host-device copies cost nothing",
        *_only("fit", _CUDA),
    ),
    "fit-ties-unbroken": (
        "the fit: candidates of equal cost not ranked by their peak",
        *_only("fit", _TIES),
    ),
    "fit-probe-dtype-ignored": (
        "the fit's measured cost: every precision at fp32's measured speed",
        *_only("fit", _MEASURED),
    ),
    "fit-micro-batch-not-freed": (
        "plan.py fit: the config's micro-batch refuses a global batch although it is searched",
        *_only("fit", _MICRO),
    ),
    "fit-slow-dtype-run": (
        "the rates probe trains the model in a dtype whose matmuls are many times slower than "
        "fp32's (minutes on a CPU without bf16 instructions)",
        *_only("fit", _SLOW),
    ),
    "pretrained-kwargs-dropped": (
        "export of a model.pretrained run: model.kwargs not applied over its config.json",
        *_only("pretrained", _KWARGS),
    ),
    "deferral-not-restored": (
        "parallel.grad_sync: FSDP2's reduction left deferred after a micro-batch raised",
        *_only("comm", _DEFER),
    ),
    "compose-one-peak": (
        "the planner's composition: the step's peak taken from one part of the step at every depth",
        *_only("plan_formulas", _COMPOSED),
    ),
    "compose-zero1-evenly": (
        "the planner's composition: ZeRO-1's AdamW states grown evenly with the blocks",
        *_only("plan_formulas", _COMPOSED),
    ),
    "planner-simulates-on-the-target": (
        "the planner simulates a CUDA plan on the target device, not the CPU",
        *_only("compare", _GPU_PLAN),
    ),
    "tp-plan-skipped": (
        "parallel.tp_size: the model's tensor-parallel plan never applied (FSDP alone, tp ranks repeat)",
        *_only("parity", _TP_STATE),
    ),
    "loss-parallel-ignored": (
        "parallel.loss_parallel: the logits gathered whole all the same",
        *_only("parity", _LOSS_PARALLEL),
    ),
    "same-batch-unchecked": (
        "a tensor-parallel group's ranks never checked to read the same batch",
        *_only("units", _SAME_BATCH),
    ),
    "tp-collectives-uncounted": (
        "comm/tp_*: tensor parallelism's collectives never counted",
        *_only("comm", _TP_COMM),
    ),
    "tokens-over-world": (
        "masked data under tensor or pipeline parallelism: trained tokens counted over every rank, "
        "not the data-parallel ones",
        *_only("masked", _TP_TOKENS),
    ),
    "stage-built-whole": (
        "parallel.pp_size: each rank builds the whole model, not its stages",
        *_only("model_plans", _PP_STAGES),
    ),
    "hybrid-data-group-one-dim": (
        "hybrid_shard with tp or pp: the data-parallel group over dp_shard alone, not replicate x "
        "shard",
        [f"tests/test_parity.py::{_SPLIT_EVAL}[hsdp-tp2]"],
        [_SPLIT_EVAL],
    ),
    "pp-norm-per-stage": (
        "parallel.pp_size: the gradient norm (and so the clipping) of a rank's stages only, not "
        "summed over the pipeline",
        [f"tests/test_parity.py::{_PARITY}[pp2]"],
        [_PARITY],
    ),
    "pp-holds-every-micro-batch": (
        "plan.py's layouts: 1F1B holds all of a step's micro-batches' activations, as GPipe does",
        *_only("fit", _PP_HELD),
    ),
    "layout-keeps-twin-activations": (
        "plan.py fit --search layout: a layout's peak keeps its ZeRO-3 twin's activations, not its own",
        *_only("fit", _LAYOUT_FIT),
    ),
    "nf4-per-shard": (
        "QLoRA: each shard's rows quantized on their own (their own scaler mean), not the whole tensor",
        *_only("qlora", _NF4_WHOLE),
    ),
    "nf4-base-checkpointed": (
        "QLoRA: checkpoints keep the NF4 base (pickled shards no export or reshard reads)",
        *_only("qlora", _NF4_RESUME),
    ),
    "nf4-base-unchecked": (
        "QLoRA: a resume rebuilds the base from whatever file is given, unchecked against the trained one",
        *_only("qlora", _NF4_RESUME),
    ),
    "nf4-counted-as-stored": (
        "QLoRA: the model-state formula counts the NF4 base at the stored dtype's bytes",
        *_only("qlora", _NF4_WHOLE),
    ),
    "low-bit-lr-frozen": (
        "low-bit AdamW: the schedule never reaches torchao's tensor learning rate (it stays optim.lr)",
        *_only("lowbit_adamw", _LOW_BIT),
    ),
    "low-bit-states-ignored": (
        "optim.state_bits: torch's AdamW built whatever it says",
        *_only("lowbit_adamw", _LOW_BIT),
    ),
    "low-bit-bytes-as-fp32": (
        "low-bit AdamW: the model-state formula counts its states at fp32's 8 B a value",
        *_only("lowbit_adamw", _LOW_BIT),
    ),
    "float8-ignored": (
        "precision.float8: no Linear converted (bf16 matmuls under a float8 setting)",
        *_only("float8", _FP8_LINEARS),
    ),
    "float8-stale-scales-after-load": (
        "float8 tensorwise: a resumed run gathers with scales computed before its weights were loaded",
        *_only("float8", _FP8_RESUME),
    ),
    "float8-gathered-at-bf16": (
        "float8 tensorwise: the communication formula counts its weights' all-gather at bf16's 2 B",
        *_only("float8", _FP8_GATHER),
    ),
    "float8-bytes-unviewed": (
        "gloo: float8 tensors all-gathered as themselves (gloo has no float8 dtype)",
        *_only("float8", _FP8_BYTES),
    ),
    "test-process-sees-gpus": (
        "the suite's own process keeps the machine's GPUs visible (its optimizer steps start CUDA)",
        *_only("cli", _GPU_HOST),
    ),
    "ds-zero3-floor": (
        "DeepSpeed import: ZeRO-3's partitions taken as floor(numel / N), not ceil (padding misread)",
        *_only("ds_import", _DS_BITS),
    ),
    "ds-schedule-unlagged": (
        "--deepspeed's schedulers: step s at the rate of s, not DeepSpeed's s - 1",
        *_only("ds_import", _DS_LR),
    ),
    "ds-samples-dropped": (
        "DeepSpeed import: the data position starts at 0, not at DeepSpeed's global samples",
        ["tests/test_ds_import.py"],
        [_DS_BITS, _DS_CONTINUED],
    ),
    "ds-moments-swapped": (
        "DeepSpeed import: exp_avg and exp_avg_sq read into each other's place",
        ["tests/test_ds_import.py"],
        [_DS_BITS, _DS_CONTINUED],
    ),
    "ds-unpickle-anything": (
        "DeepSpeed import: its files unpickled with weights_only=False (any class, any code)",
        *_only("ds_import", _DS_DAMAGED),
    ),
    "nf4-block-size-ignored": (
        "QLoRA: model.lora.nf4_block_size never reaches the quantizer (always 64; the record says otherwise)",
        *_only("qlora", _NF4_BLOCK),
    ),
    "nf4-resume-checks-source-path": (
        "QLoRA resume: the rebuilt base checked by its file path, not its NF4 digest",
        *_only("qlora", _NF4_DIGEST),
    ),
    "lowbit-eps-ignored": (
        "optim.state_bits=8/4: optim.eps never reaches torchao's AdamW (its default 1e-8)",
        *_only("lowbit_adamw", _LOW_BIT_SETTINGS),
    ),
    "lowbit-partial-blocks-counted": (
        "adamw_state_bytes: a shard of 4,096+ values that is not whole blocks counted as low-bit (torchao "
        "keeps it fp32)",
        *_only("lowbit_adamw", _LOW_BIT_BYTES),
    ),
    "float8-rowwise-counted-as-float8-gather": (
        "float8 rowwise and mxfp8 planned as all-gathering in float8 (the formula's 1 B a weight, the "
        "start-up line)",
        *_only("float8", _FP8_WHICH),
    ),
    "ds-ranks-sorted-as-text": (
        "DeepSpeed import: rank files taken in file-name order (rank_10 before rank_2)",
        *_only("ds_import", _DS_RANKS),
    ),
    "ds-import-ignores-deepspeed-flag": (
        "import_deepspeed.py --deepspeed JSON ignored: the ds_config saved in the checkpoint used instead",
        *_only("ds_import", _DS_FLAG),
    ),
    "table-struct-nulls-kept": (
        "prepare_data: a chat message's null struct fields kept (name: None where its JSON had no name)",
        *_only("datasets", _TABLE_FIELDS),
    ),
    "tp-plan-index-one-digit": (
        "parallel.tp_size: a plan pattern's * matched as one digit: from layers.10 on no layer is split",
        *_only("model_plans", _TP_TWELVE),
    ),
    "pp-remainder-layers-dropped": (
        "parallel.pp_size: the layers the stages do not divide evenly go to no stage",
        *_only("model_plans", _PP_STAGES),
    ),
    "tp-norm-first-mesh-only": (
        "parallel.tp_size without sequence parallelism: the gradient norm (and the clipping) of the split "
        "layers' mesh only, the norm gains' left out",
        [f"tests/test_models.py::{_FOREIGN}[llama-tp2]"],
        [_FOREIGN],
    ),
    "pp-same-batch-unchecked": (
        "the first-batch check over a rank's tensor-parallel group only, not its pipeline",
        [f"tests/test_units.py::{_SAME_BATCH}", f"tests/test_units.py::{_SAME_GROUPS}"],
        [_SAME_BATCH, _SAME_GROUPS],
    ),
    "layout-pp-held-no-gradients": (
        "plan.py's pipeline layouts: a stage's unsharded gradients left out of what it holds in the step",
        *_only("fit", _LAYOUT_PEAK),
    ),
    "layout-p2p-one-way": (
        "plan.py fit --search layout: the bytes crossing a stage boundary counted one way, not forward and back",
        *_only("fit", _LAYOUT_FIT),
    ),
    "layout-tp-gathered-whole": (
        "plan.py fit --search layout: a tp candidate holds its twin's gathered parameters whole, not a tp rank's part",
        *_only("fit", _LAYOUT_PEAK),
    ),
    "compose-host-state-shallow": (
        "the planner's composition, CPU offload on CUDA: the shallow simulation's host state taken off the peak",
        [f"tests/test_plan_formulas.py::{_COMPOSED}[cuda-offload]"],
        [_COMPOSED],
    ),
    "rates-block-slope-off-by-one": (
        "the rates probe: a block's seconds the slope over its deeper cut's blocks, not the blocks between "
        "the cuts",
        *_only("fit", _PROBE_SLOPE),
    ),
    "decay-1d-ignored": (
        "optim.decay_1d never reaches AdamW's groups: the 1-D parameters are not decayed",
        *_only("ds_import", _DS_CONTINUED),
    ),
    "ds-adam-step-from-global-steps": (
        "DeepSpeed import, ZeRO-1/2: AdamW's step taken from global_steps (which counts fp16's skipped "
        "steps), not the optimizer's state",
        *_only("ds_import", _DS_ADAM_STEP),
    ),
    # issue 44's tables: the refusal rows, the constraints beside the fields, the grid's declared roles
    "refusal-rows-after-the-first-skipped": (
        "config.rules.REFUSALS: only the first row of the table is checked",
        *_only("rules", _REFUSAL_ROWS),
    ),
    "field-constraint-unchecked": (
        "config.constraints.check_fields: a value outside the bound its field declares passes",
        *_only("config", _FIELD_BOUND),
    ),
    "grid-joins-ignored": (
        "distributed.topology: a declared axis never joins the roles it names (context parallelism "
        "left out of the loss and FSDP's shard groups)",
        *_only("topology", _GRID_JOINS),
    ),
    # issue 45: optimizer states in host memory or files, group by group
    "offload-group-never-written-back": (
        "offload.states: a group's stepped states never written back to their tier (the next step "
        "reads the old ones)",
        *_only("offload", _TIERED),
    ),
    "offload-prefetch-wrong-group": (
        "offload.states: the read-ahead fills the next group's buffer with the group just stepped",
        *_only("offload", _TIERED),
    ),
    "offload-ratio-ignored": (
        "offload.ratio: every step group offloaded whatever the ratio",
        *_only("offload", _TIERED),
    ),
    "ds-nvme-offload-in-memory": (
        "--deepspeed: offload_optimizer.device=nvme keeps the moments in host memory instead of its "
        "nvme_path",
        *_only("deepspeed_offload", _DS_OFFLOAD),
    ),
    "step-reads-the-loss": (
        "Step.run: one more host read a step (the loss read with .item() before the optimizer step)",
        *_only("host_reads", _ONE_READ),
    ),
    "gate-read-before-fused-adamw": (
        "Step.run: fused AdamW launched only after the gate's read (the device idles while the host "
        "waits for the backward, then launches the step)",
        *_only("host_reads", _ONE_READ),
    ),
    "fused-skip-ignored": (
        "fused AdamW launched before the gate's read does not skip a non-finite step on the device",
        *_only("host_reads", _SKIP_ON_DEVICE),
    ),
    "trace-steps-in-throughput": (
        "metrics.trace_steps: the traced steps counted in the throughput (tokens/s, step_s)",
        *_only("trace", _TRACE_RATE),
    ),
    "trace-runs-split": (
        "metrics.trace_steps: consecutive traced steps not sharing one trace",
        *_only("trace", _TRACE_RUNS),
    ),
    "rope-cast-to-compute": (
        "the rotary table reaches rotary in the compute dtype under the -mixed precisions (as "
        "FSDP2's input cast made it)",
        ["tests/test_casts.py"],
        ["test_each_block_receives_the_rope_table_in_fp32_and_rotary_rounds_once"],
    ),
    "cast-finder-blind": (
        "the cast finder sees none of the inputs FSDP2 casts",
        ["tests/test_casts.py"],
        ["test_the_cast_finder_lists_what_fsdp_casts_per_unit_and_argument"],
    ),
    "last-unit-resharded": (
        "the last unit resharded after its forward and gathered again for its backward at once",
        *_only("comm", "test_counted_bytes_per_step_equal_the_formula"),
    ),
    "data-prefetch-never-started": (
        "data.loader: the next batch is never fetched while the step runs (made when asked for)",
        *_only("data_path", _AHEAD),
    ),
    "data-prefetch-kept-after-seek": (
        "data.loader: after position is set, the batch fetched for the old position is served",
        *_only("data_path", _SEEK),
    ),
    "ds-no-scheduler-ours": (
        "--deepspeed: a ds_config without a scheduler trains with our warm-up and cosine instead of "
        "DeepSpeed's constant learning rate",
        ["tests/test_deepspeed.py::test_every_mapped_key_resolves_as_its_native_equivalent"],
        ["test_every_mapped_key_resolves_as_its_native_equivalent"],
    ),
    # issue 47: long sequences
    "sp-all-to-all-wrong-dim": (
        "sequence parallelism: the gathered slices interleaved into the sequence (wrong dimension)",
        *_SP2_PARITY,
    ),
    "sp-positions-restart": (
        "sequence parallelism: each slice rotated at positions 0.. of its own (restarted per slice)",
        *_SP2_PARITY,
    ),
    "sp-loss-per-rank": (
        "sequence parallelism: the masked loss weighted per rank's slice, not per group's token",
        [f"tests/test_masked.py::{_TP_TOKENS}[masked-sp2]"],
        [_TP_TOKENS],
    ),
    "sp-all-to-all-uncounted": ("sp: the all-to-alls' bytes not counted", *_only(_SEQ, _SP_BYTES)),
    "sp-eval-unsliced": ("sp: evaluation forwards whole windows on each rank", *_SP_EVAL),
    "tiled-loss-logits-kept": (
        "train.loss_chunk: each chunk's logits kept for backward, not recomputed: the untiled peak",
        *_only("tiled_loss", "test_the_logits_of_one_chunk_only_are_alive"),
    ),
    "tiled-loss-chunk-dropped": (
        "train.loss_chunk: the last chunk's tokens left out of the loss",
        *_only(
            "tests/test_tiled_loss.py", "test_the_tiled_loss_and_gradients_are_the_untiled_ones"
        ),
    ),
    "act-offload-no-copy": (
        "activation offload's pack keeps the tensor instead of a host copy",
        *_only(
            "tests/test_act_offload.py", "test_the_hooks_move_only_the_blocks_inputs_as_host_copies"
        ),
    ),
    "act-offload-hook-not-first": (
        "activation offload's hooks entered after checkpointing's: nothing is moved",
        *_OFFLOADED,
    ),
    "act-offload-in-recompute": (
        "activation offload's hooks also catch what the recompute saves",
        *_OFFLOADED,
    ),
    "ep-combine-misrouted": (
        "ep: the experts' outputs summed into the wrong tokens",
        *_ep("ep2-dp2"),
    ),
    "ep-aux-dropped": ("the load-balancing loss left out of the training loss", *_ep("ep2")),
    "ep-norm-per-rank": (
        "the norm's local squares summed over every rank (replicas)",
        *_ep("hsdp-ep2"),
    ),
    "ep-grads-undivided": (
        "ep: the experts' gradients averaged over the ranks ep leaves",
        *_ep("ep2-dp2"),
    ),
}
