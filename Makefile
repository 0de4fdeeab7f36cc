# Every target sets up .venv by itself: torch==2.13.0 first (a local CPU build on these
# machines), then this package with its dev extras.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.nebula-installed

# Azurite, the Azure Blob Storage emulator the tests start (npm; Node.js >= 18 needed).
AZURITE_VERSION := 3.35.0
AZURITE := .azurite/node_modules/.bin/azurite-blob
# Put Block From URL (a persist's unchanged ranges staged from the previous blob) came in
# Azurite 3.37.0; 3.35.0 answers 501 and nebula uploads whole. The tests of those ranges
# and the LoRA benchmark's Azurite row run this second one, beside the suite's.
AZURITE_COPY_VERSION := 3.37.0
AZURITE_COPY := .azurite-$(AZURITE_COPY_VERSION)/node_modules/.bin/azurite-blob

.PHONY: venv test check lint demo scale reliability clean azurite bench bench-azure bench-s3 bench-peers bench-peft bench-stall bench-dlrover venv-dlrover test-integrations bug-round

# The suite runs in parallel workers (pytest-xdist): each starts with an even share of the
# tests, in the order they are collected, and a worker that runs out takes half of the
# longest queue. 2 workers on 2 cores: the suite is bound by CPU (child processes that
# run torch and the frameworks), and more workers only add contention (rank timeouts
# under load). What several tests share (a built wheel, a DeepSpeed job) is made once for
# the run: tests/shared_setup.py. The children that run nebula and torch start warm,
# forked from a process per worker that imported torch once (tests/warm.py);
# NEBULA_TESTS_COLD=1 starts each as a real `python` instead.
WORKERS ?= 2
PYTEST  := $(PY) -m pytest -n $(WORKERS) --dist worksteal

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,deepspeed,lightning,transformers]'
	# DeepSpeed's CPU all-reduce op, compiled once here (about 2 min on 2 cores) instead of
	# just-in-time by the first DeepSpeed test; its build needs torch: no build isolation.
	ls $(VENV)/lib/python3*/site-packages/deepspeed/ops/comm/deepspeed_shm_comm_op*.so >/dev/null 2>&1 || \
		DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(PY) -m pip install -q --no-build-isolation \
			--no-cache-dir --force-reinstall --no-deps 'deepspeed==0.19.6'
	# xfsprogs, for the test that persists onto an XFS loop mount with reflinks (root
	# only; without it that test is skipped, saying why).
	command -v mkfs.xfs >/dev/null || { test "$$(id -u)" = 0 && \
		apt-get install -y -q --no-install-recommends xfsprogs >/dev/null 2>&1; } || true
	# zsh, for the test that runs the zsh completion script (root only; without it that
	# test is skipped, saying why).
	command -v zsh >/dev/null || { test "$$(id -u)" = 0 && { \
		apt-get install -y -q --no-install-recommends zsh || { apt-get update -q && \
		apt-get install -y -q --no-install-recommends zsh; }; } >/dev/null 2>&1; } || true
	# strace, for the test that records a persist's fsyncs in their order (root only;
	# without it that test is skipped, saying why).
	command -v strace >/dev/null || { test "$$(id -u)" = 0 && { \
		apt-get install -y -q --no-install-recommends strace || { apt-get update -q && \
		apt-get install -y -q --no-install-recommends strace; }; } >/dev/null 2>&1; } || true
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

$(AZURITE):
	npm install --prefix .azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)

$(AZURITE_COPY):
	npm install --prefix .azurite-$(AZURITE_COPY_VERSION) --no-audit --no-fund --loglevel=error \
		azurite@$(AZURITE_COPY_VERSION)

azurite: $(AZURITE) $(AZURITE_COPY)

# Everything: lint, types, every test (unit, doctests, multi-rank, frameworks, Azurite,
# the wheel, the demo). Each step says how long it took. mypy (about a minute on 2 cores,
# no cache on a clean clone) runs beside the tests: they leave a core idle while they wait
# on child processes; its report and status come after theirs.
TYPES_LOG := $(VENV)/.nebula-mypy.log
# The checkout's modules compiled first (about 2 s): with PYTHONDONTWRITEBYTECODE set, as
# on many CI machines, each of the suite's hundreds of child processes would compile every
# nebula module it imports again (0.15-0.25 s of CPU each time).
COMPILE := $(PY) -m compileall -q -j 0 core nebula_cli tests examples benchmarks conftest.py
test: venv $(AZURITE) $(AZURITE_COPY)
	@start=$$(date +%s); $(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && \
		$(COMPILE) >/dev/null && echo "ruff and compileall: $$(( $$(date +%s) - start )) s"
	@start=$$(date +%s); \
		( $(VENV)/bin/mypy > $(TYPES_LOG) 2>&1; echo "mypy exit $$? after $$(( $$(date +%s) - start )) s" >> $(TYPES_LOG) ) & \
		$(PYTEST); rc=$$?; echo "pytest: $$(( $$(date +%s) - start )) s"; \
		wait; cat $(TYPES_LOG); grep -q '^mypy exit 0 ' $(TYPES_LOG) || rc=1; \
		echo "pytest and mypy: $$(( $$(date +%s) - start )) s"; exit $$rc

# The fast loop for developers (about 2.5 minutes on a quiet 2-core machine): ruff and the
# tests not marked slow. make test and CI run everything.
check: venv $(AZURITE) $(AZURITE_COPY)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(COMPILE) >/dev/null
	$(PYTEST) -m "not slow"

demo: venv
	$(PY) examples/train.py --demo

# The peer benchmark (issue #3): nebula vs torch.save, DCP and torchsnapshot on a GPT-2-style
# state built in memory, then the LoRA fine-tune workload (issue #30: a 200 MB state, 95%
# frozen, and its all-changed control; nebula to a local root and to an Azurite it starts;
# about 2 min), then peer replicas (bench-peers below). `make bench PRESET=small` for a quick
# run (~7.5 min); default ~33 min on 2 cores (bench.py alone ~23 min).
# `make bench BENCH_ARGS='--workloads lora'` runs the LoRA workload alone.
PRESET ?= default
BENCH_STAMP := $(VENV)/.nebula-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

BENCH_ARGS ?=
# Then peer replicas (issue #44, benchmarks/peer_replicas.py, 3.5-5.5 min on 2 cores; ~3.5 min
# with PRESET=small, which runs 2 loops of each kind and 1 restart of each; PEERS=0 skips it).
PEERS ?= 1
PEERS_ARGS ?= $(if $(filter small,$(PRESET)),--runs 2 --recoveries 1,)
bench: $(BENCH_STAMP) $(DLROVER_STAMP) $(AZURITE) $(AZURITE_COPY)
	$(PY) benchmarks/bench.py --preset $(PRESET) $(BENCH_ARGS)
	$(PY) benchmarks/trainer_peft.py
	$(PY) benchmarks/persist_stall.py $(STALL_ARGS)
	test "$(PEERS)" = 0 || $(PY) benchmarks/peer_replicas.py $(PEERS_ARGS)

# What a persist in flight costs the loop (issue #49, part of `make bench`; about 3 min
# on 2 cores): save() stall median and p90 with every checkpoint persisted while the next
# steps run against none, and with spare_buffers off; the memory tier's footprint. Two
# loops: AdamW under the default (copies deferred) and a state changed in place (copied
# at save()).
STALL_ARGS ?= $(if $(filter small,$(PRESET)),--mb 160 --runs 1,)
bench-stall: venv
	$(PY) benchmarks/persist_stall.py $(STALL_ARGS)

# DLRover's Flash Checkpoint, a peer in `make bench` (issue #49), in an environment of its
# own, kept out of .venv: torch==2.13.0 first (the same local CPU build: pip never picks
# another torch), then dlrover[torch] (which asks for torch unpinned) and grpcio (its flash
# checkpoint imports grpc; protobuf is not needed). Where it cannot be made (no registry),
# the rule says so and the bench shows DLRover's row as unavailable.
DLROVER_VENV    := .venv-dlrover
DLROVER_VERSION := 0.6.1
DLROVER_STAMP   := $(DLROVER_VENV)/.nebula-dlrover-installed
$(DLROVER_STAMP):
	{ test -x $(DLROVER_VENV)/bin/python || python3 -m venv $(DLROVER_VENV); } && \
	$(DLROVER_VENV)/bin/python -m pip install -q torch==2.13.0 numpy && \
	$(DLROVER_VENV)/bin/python -m pip install -q 'dlrover[torch]==$(DLROVER_VERSION)' grpcio && \
	touch $@ || echo "$(DLROVER_VENV) could not be made: the bench shows DLRover as unavailable"

venv-dlrover: $(DLROVER_STAMP)

# DLRover's row alone (issue #49; about 1.5 min with PRESET=small on 2 cores): nebula's
# default save, DCP's reused stager and DLRover's memory save on the same state, 10 saves
# each, stall median and p90 side by side with their ratios, then DLRover's buffer, its
# saver process and its resume (bit-exact checks; what a resume from memory aliases).
DLROVER_ARGS ?= --repeats 10
bench-dlrover: $(BENCH_STAMP) $(DLROVER_STAMP)
	$(PY) benchmarks/bench.py --preset $(PRESET) --workloads full --loop-steps 0 \
		--methods nebula dcp_async_reused dlrover \
		--json benchmarks/results/bench-$(PRESET)-dlrover.json $(DLROVER_ARGS)

# A peft LoRA fine-tune under the Hugging Face Trainer (issue #48, part of `make bench`, about
# 1.5 min on 2 cores): disk bytes per checkpoint (/proc/self/io write_bytes), NebulaCallback
# vs the Trainer's own files.
bench-peft: venv
	$(PY) benchmarks/trainer_peft.py

# Peer replicas alone (issue #44): on 2 simulated nodes, save() stall with peer_replicas=1
# vs 0, bytes on the wire vs bytes changed, recovery of a lost node from its partner vs
# the persistent tier (local disk and an Azurite it starts), memory-tier footprint.
bench-peers: venv $(AZURITE) $(AZURITE_COPY)
	$(PY) benchmarks/peer_replicas.py $(PEERS_ARGS)

# Commit latency against the number of ranks (scale.py), then metadata at scale (issue #29,
# metadata_scale.py: 100 / 1,000 / 10,000 tags locally, 100 / 1,000 on Azurite; about
# 15 min on 2 cores), then a restart's cost at those sizes (#47, restart_scale.py). `make scale
# METADATA_ARGS=--quick` times 100 and 1,000 local tags only.
METADATA_ARGS ?=
scale: venv $(AZURITE)
	$(PY) benchmarks/scale.py --ranks 64 128 256 --repeats 3
	$(PY) benchmarks/metadata_scale.py $(METADATA_ARGS)
	$(PY) benchmarks/restart_scale.py $(METADATA_ARGS)

# Persist throughput (benchmarks/store_persist.py): nebula's persist against the store's own
# upload of the same bytes (256 MiB, median of 3), bytes counted as the store lists them.
# bench-azure: to an Azurite it starts (about 20 s on 2 cores); bench-s3: to a local disk,
# that Azurite and moto's S3 server (which it starts too), in one run (about 1 min).
bench-azure: venv $(AZURITE)
	$(PY) benchmarks/store_persist.py --stores azure

bench-s3: venv $(AZURITE)
	$(PY) benchmarks/store_persist.py --stores local azure s3

test-integrations: venv
	$(PYTEST) tests/integrations

reliability: venv
	$(PY) tests/reliability/run.py

# Realistic bugs injected one at a time into a temporary copy of the repository, each
# with the test files that must catch it; prints which test caught each (about 2 min).
bug-round: venv
	$(PY) tests/bug_round.py

clean:
	if test -x $(PY); then $(PY) -c "import nebulaml as nm, shutil; \
		shutil.rmtree(nm.memory_tier_path('demo-checkpoints'), ignore_errors=True)"; fi
	rm -rf demo-checkpoints .pytest_cache .ruff_cache
