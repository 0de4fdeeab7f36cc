"""A training process for the Azurite kill/restart test (tests/azure/test_azure_kill_restart.py).

    persist_child.py URL CONNECTION_STRING SIZE_MB

Saves and persists global_step1 (small), waits for "go" on stdin, then saves
global_step2 (SIZE_MB of float32 from a fixed seed) and persists it while the test kills
and restarts Azurite. Retries are long enough to outlast a restart (10 tries, backoff up
to 1 s). A failed persist is reported through the API and training goes on: the process
prints its progress on stdout and exits 0 unless nebula itself crashed it.
"""

from __future__ import annotations

import sys

import torch

import nebulaml as nm


def state(step: int, size_mb: int) -> dict[str, torch.Tensor]:
    numel = (size_mb << 20) // 4
    return {"w": torch.randn(numel, generator=torch.Generator().manual_seed(1000 + step))}


def main() -> int:
    url, connection_string, size_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = {
        "connection_string": connection_string,
        "nebula_retries": 10,
        "nebula_retry_base_s": 0.2,
        "nebula_retry_max_s": 1.0,
        # Small blocks, two in flight: the upload lasts long enough to be cut in the middle.
        "nebula_block_bytes": 1 << 20,
        "nebula_upload_concurrency": 2,
    }
    nm.init(url, persistent_time_interval=3600, storage_options=options, exit_timeout_s=120)
    nm.Checkpoint("global_step1").save("model", state(1, 1))
    nm.flush_persistence()
    print("COMMITTED global_step1", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    nm.Checkpoint("global_step2").save("model", state(2, size_mb))
    print("PERSISTING global_step2", flush=True)
    try:
        nm.flush_persistence()
        print("PERSISTED global_step2", flush=True)
    except nm.PersistError as exc:
        print(f"PERSIST_ERROR {' '.join(str(exc).split())}", flush=True)
    # Training goes on whatever the persist did.
    loss = sum(float(torch.ones(64, 64).matmul(torch.ones(64, 64)).sum()) for _ in range(3))
    print(f"TRAINING_CONTINUED {loss:.0f}", flush=True)
    try:
        nm.shutdown(timeout_s=120)
    except nm.NebulaError as exc:
        print(f"SHUTDOWN_ERROR {' '.join(str(exc).split())}", flush=True)
    print("EXIT 0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
