# Every target a person runs. `make demo` and `make test` work on a fresh clone:
# they create the virtualenv and install everything they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo serve test test-unit lint migrate bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

serve: $(STAMP)
	$(BIN)/tierckpt serve $(if $(CONFIG),--config $(CONFIG))

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

lint: $(STAMP)
	$(BIN)/ruff check service client migrations tests benchmarks examples
	$(BIN)/ruff format --check service client migrations tests benchmarks examples
	$(BIN)/mypy service client

migrate: $(STAMP)
	$(BIN)/tierckpt migrate $(if $(CONFIG),--config $(CONFIG))

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) .tierckpt .pytest_cache build *.egg-info
