# Two commands do all the set-up: `make train` and `make test` create .venv and
# install fsdp-zero into it on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
NPROC ?= 2
ARGS ?=

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

.PHONY: install train test bench
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train.py $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) bench/step_time.py $(ARGS)
