# Every target sets up .venv by itself: torch==2.13.0 first (a local CPU build on these
# machines), then this package with its dev extras.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.nebula-installed

# Azurite, the Azure Blob Storage emulator the tests start (npm; Node.js >= 18 needed).
AZURITE_VERSION := 3.35.0
AZURITE := .azurite/node_modules/.bin/azurite-blob

.PHONY: venv test lint demo scale reliability clean azurite bench-azure

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

$(AZURITE):
	npm install --prefix .azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)

azurite: $(AZURITE)

test: lint $(AZURITE)
	$(PY) -m pytest

demo: venv
	$(PY) examples/train.py --demo

scale: venv
	$(PY) benchmarks/scale.py --ranks 64 128 256 --repeats 3

bench-azure: venv $(AZURITE)
	$(PY) benchmarks/azure_persist.py

reliability: venv
	$(PY) tests/reliability/run.py

clean:
	if test -x $(PY); then $(PY) -c "import nebulaml as nm, shutil; \
		shutil.rmtree(nm.memory_tier_path('demo-checkpoints'), ignore_errors=True)"; fi
	rm -rf demo-checkpoints .pytest_cache .ruff_cache
