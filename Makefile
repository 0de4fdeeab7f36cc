# Every target sets up .venv by itself: torch==2.13.0 first (a local CPU build on these
# machines), then this package with its dev extras.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.nebula-installed

# Azurite, the Azure Blob Storage emulator the tests start (npm; Node.js >= 18 needed).
AZURITE_VERSION := 3.35.0
AZURITE := .azurite/node_modules/.bin/azurite-blob

.PHONY: venv test lint demo scale reliability clean azurite bench bench-azure test-integrations

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,deepspeed,lightning,transformers]'
	# DeepSpeed's CPU all-reduce op, compiled once here (about 2 min on 2 cores) instead of
	# just-in-time by the first DeepSpeed test; its build needs torch: no build isolation.
	ls $(VENV)/lib/python3*/site-packages/deepspeed/ops/comm/deepspeed_shm_comm_op*.so >/dev/null 2>&1 || \
		DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(PY) -m pip install -q --no-build-isolation \
			--no-cache-dir --force-reinstall --no-deps 'deepspeed==0.19.6'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

$(AZURITE):
	npm install --prefix .azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)

azurite: $(AZURITE)

test: lint $(AZURITE)
	$(PY) -m pytest

demo: venv
	$(PY) examples/train.py --demo

# The peer benchmark (issue #3): nebula vs torch.save, DCP and torchsnapshot on a GPT-2-style
# state built in memory. `make bench PRESET=small` for a quick run (~2 min); default ~15 min.
PRESET ?= default
BENCH_STAMP := $(VENV)/.nebula-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench.py --preset $(PRESET)

scale: venv
	$(PY) benchmarks/scale.py --ranks 64 128 256 --repeats 3

bench-azure: venv $(AZURITE)
	$(PY) benchmarks/azure_persist.py

test-integrations: venv
	$(PY) -m pytest tests/integrations

reliability: venv
	$(PY) tests/reliability/run.py

clean:
	if test -x $(PY); then $(PY) -c "import nebulaml as nm, shutil; \
		shutil.rmtree(nm.memory_tier_path('demo-checkpoints'), ignore_errors=True)"; fi
	rm -rf demo-checkpoints .pytest_cache .ruff_cache
