# Set-up and entry points. `make demo` and `make test` create .venv themselves.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: demo test lint typecheck check bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py hicache_obs/_copy.c hicache_obs/_logcore.c hicache_obs/_slots.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned, so that nothing else can pull a newer (CUDA) build
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache-obs demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	$(VENV)/bin/hicache-obs bench

clean:
	rm -rf $(VENV) hicache-demo .pytest_cache .mypy_cache .ruff_cache
