# Every target a person runs. `make demo` and `make test` work on a fresh clone:
# they create the virtualenv and install everything they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install browser slurm demo serve test test-unit chaos lint migrate bench bench-table docs clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# PyTorch (CPU build) for the trainer helpers, their tests and `make demo`.
	$(BIN)/pip install -q torch==2.13.0 safetensors numpy
	# Lightning and Hugging Face for their integrations' tests (CPU; torch stays pinned).
	$(BIN)/pip install -q torch==2.13.0 lightning transformers accelerate
	touch $(STAMP)

install: $(STAMP)

# The dashboard test drives Debian's chromium through Playwright (whose own
# browser download is not used). As root (CI) it is installed when missing;
# otherwise that test skips with the reason (and fails when CI is set).
CHROMIUM ?= /usr/bin/chromium
browser:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    if ! apt-cache policy chromium 2>/dev/null | grep -q 'Candidate: [0-9]'; then \
	      apt-get update -qq; \
	    fi; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else \
	    echo "note: $(CHROMIUM) is missing and this is not root: the browser test will skip"; \
	  fi; \
	fi

# The Slurm e2e test runs a real one-node cluster (Debian's slurm-wlm + munge).
# As root (CI) they are installed when missing; otherwise that test skips.
slurm:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    if ! apt-cache policy slurm-wlm 2>/dev/null | grep -q 'Candidate: [0-9]'; then \
	      apt-get update -qq; \
	    fi; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; \
	  else \
	    echo "note: slurm-wlm/munge are missing and this is not root: the Slurm test will skip"; \
	  fi; \
	fi

demo: $(STAMP)
	$(BIN)/python -m examples.demo

serve: $(STAMP)
	$(BIN)/tierckpt serve $(if $(CONFIG),--config $(CONFIG))

# The suite runs on TEST_WORKERS pytest-xdist workers: most of its time is
# spent waiting on real processes (agents starting, uploads, SIGKILLed
# trainers), so several workers overlap those waits even on a 2-core machine.
# Every test has its own ports, directories, buckets and PostgreSQL database
# (conftest.py), so workers share nothing. TEST_WORKERS=0 runs it serially.
# Work stealing: xdist's default hands each worker its share up front, and
# the end-to-end tests (up to a minute each, collected together) piled up on
# one worker while the other finished the rest and stopped, half-way through.
# A module's tests may then run on several workers, so a module-scoped fixture
# must stand on its own when it is set up twice.
# The slowest tests are listed at the end of every run: `make test` is kept
# under 15 minutes, and on a slow machine that list says where it goes.
# Three workers, not two, on a 2-core machine: the tests' own waits (agents
# starting, polls, leases, drains) leave a third of two workers' CPU idle;
# with 3 the suite ended sooner than with 2, and never later (commit 46feb57
# has the figures).
TEST_WORKERS ?= 3
test: $(STAMP) browser slurm
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(if $(filter-out 0,$(TEST_WORKERS)),--dist worksteal) --durations=25 $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The chaos test, long form (`make test` runs it short, TIERCKPT_CHAOS_SECONDS=20):
# SIGKILLs, a region stopped and started, corrupted objects, under load; prints
# the figures (kills, outages, corruptions, losses). CHAOS_SECONDS=600 for more.
CHAOS_SECONDS ?= 300
chaos: $(STAMP)
	TIERCKPT_CHAOS_SECONDS=$(CHAOS_SECONDS) $(BIN)/python -m pytest -q -m chaos \
	  -o timeout=$$(( $(CHAOS_SECONDS) + 900 )) tests/e2e/test_chaos.py

lint: $(STAMP)
	$(BIN)/ruff check service client migrations devsupport tests benchmarks examples
	$(BIN)/ruff format --check service client migrations devsupport tests benchmarks examples
	$(BIN)/mypy service client devsupport benchmarks examples

migrate: $(STAMP)
	$(BIN)/tierckpt migrate $(if $(CONFIG),--config $(CONFIG))

# Writes benchmarks/results/latest.json, then README.md's Measured table from it.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(if $(QUICK),--quick)
	$(BIN)/python -m benchmarks.table

# README.md's Measured table from benchmarks/results/latest.json (a unit test checks it is current).
bench-table: $(STAMP)
	$(BIN)/python -m benchmarks.table

# docs/configuration.md is generated from service/config.py (a test checks it is current).
docs: $(STAMP)
	$(BIN)/python -m tierckpt.service.config_reference > docs/configuration.md

clean:
	rm -rf $(VENV) .tierckpt .pytest_cache build *.egg-info
