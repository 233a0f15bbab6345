# Two commands do all the set-up: `make train` and `make test` create .venv and
# install fsdp-zero into it on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
NPROC ?= 2
ARGS ?=
# Tests marked slow (a 160M model under a memory cap, compiled blocks, a two-node launch, a hung rank, an elastic restart,
# SIGTERM and a time budget: about 3 minutes) are left out of the default run to keep it under CI's
# 10 minutes on 2 cores: `make test MARK=slow` runs them, `make test MARK=` runs everything.
MARK ?= not slow

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

.PHONY: install train test bench
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train.py $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -m "$(MARK)" $(ARGS)

bench: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) bench/step_time.py $(ARGS)
