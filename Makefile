# Two commands do all the set-up: `make train` and `make test` create .venv and
# install fsdp-zero into it on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
NPROC ?= 2
ARGS ?=
# `make test` runs every test (those marked gpu skip where no GPU is visible): CI runs it, and it
# stays under 8 minutes on 2 cores. `make test-quick` leaves out the tests marked slow (a 160M model
# under a memory cap, the Slurm and Kubernetes launches, a hung rank, SIGTERM): about 2 minutes
# less, for a developer's own loop. `make mutants` injects wrong behaviours and shows the suite fails.
# `make docs` regenerates the reference blocks in docs/ (scripts/docs.py); tests/test_docs.py fails when one is stale.
MARK ?=

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

.PHONY: install train test test-quick test-gpu-host mutants bench docs format gpu-check deepspeed-runs ds-vs-ours
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train.py $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q $(if $(MARK),-m "$(MARK)") $(ARGS)

test-quick: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -m "not slow" $(ARGS)

# Every test not marked gpu on a simulated GPU host (tests/fake_gpu: torch sees 2 GPUs, any real use of CUDA
# fails): what `make test` does on a machine with a GPU, short of the gpu tests themselves.
test-gpu-host: $(VENV)/.installed
	PYTHONPATH=tests/fake_gpu FSDP_ZERO_FAKE_GPUS=2 $(VENV)/bin/python -m pytest -q -m "not gpu" $(ARGS)

mutants: $(VENV)/.installed
	$(VENV)/bin/python tests/mutants.py $(ARGS)

bench: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) bench/step_time.py $(ARGS)

docs: $(VENV)/.installed
	$(VENV)/bin/python scripts/docs.py $(ARGS)

# ruff's formatter and linter, as pyproject.toml sets them; tests/test_layout.py fails until the tree is clean.
format: $(VENV)/.installed
	$(VENV)/bin/ruff format fsdp_zero scripts bench tests
	$(VENV)/bin/ruff check --fix fsdp_zero scripts bench tests

# `make gpu-check` on a one-GPU machine (6 minutes on one H100, docs/benchmarks.md): `pytest -m gpu`, then
# bench/gpu_check.py's figures (docs/benchmarks.md). Its CPU-side parts run in `make test` (--dry-run).
gpu-check: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -m gpu
	$(VENV)/bin/python bench/gpu_check.py

# The real DeepSpeed runs whose checkpoints tests/test_ds_import.py imports (tests/deepspeed_runs/, committed):
# DeepSpeed goes into .deepspeed/ (pip --target: not in .venv, not a dependency; its build imports torch, hence
# --no-build-isolation), then runs on the CPU over gloo at 2 and 3 ranks (about 1 minute).
DEEPSPEED ?= deepspeed==0.19.8
.deepspeed/.installed: $(VENV)/.installed
	DS_BUILD_OPS=0 $(VENV)/bin/pip install -q --no-build-isolation --no-deps --target .deepspeed "$(DEEPSPEED)" \
		einops hjson msgpack ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection
	touch $@

deepspeed-runs: .deepspeed/.installed
	for n in 2 3; do PYTHONPATH=.deepspeed DS_ACCELERATOR=cpu $(VENV)/bin/torchrun --standalone \
		--nproc_per_node=$$n tests/deepspeed_runs/make.py || exit 1; done

# fsdp-zero against DeepSpeed ZeRO-3 side by side, 2 ranks on the CPU (about 4 minutes on a quiet machine;
# docs/benchmarks.md); ARGS=--quick for a dry run
ds-vs-ours: .deepspeed/.installed
	$(VENV)/bin/python bench/ds_vs_ours.py $(ARGS)
