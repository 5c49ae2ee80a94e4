# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install test demo lint bench clean

install: $(STAMP)

# torch first, pinned to the CPU wheel this machine carries on disk, so that no
# other requirement can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# The whole fleet on this machine: Redis (KVFLEET_REDIS_URL or a local one), the demo
# model, a worker, the finalizer and the API; submits examples/prompts.jsonl and waits.
demo: $(STAMP)
	$(BIN)/python -m workers.demo --prompts examples/prompts.jsonl --out out

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) out .pytest_cache
