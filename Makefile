# Every target sets up .venv by itself: torch==2.13.0 first (a local CPU build on these
# machines), then this package with its dev extras.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.nebula-installed

.PHONY: venv test lint demo scale clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest

demo: venv
	$(PY) examples/train.py --demo

scale: venv
	$(PY) benchmarks/scale.py --ranks 64 128 256 --repeats 3

clean:
	if test -x $(PY); then $(PY) -c "import nebulaml as nm, shutil; \
		shutil.rmtree(nm.memory_tier_path('demo-checkpoints'), ignore_errors=True)"; fi
	rm -rf demo-checkpoints .pytest_cache .ruff_cache
