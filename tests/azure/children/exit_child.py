"""A script that ends without nm.shutdown() on an Azurite root (test_azure_exit.py).

    exit_child.py URL HOW

global_step1 is saved and persisted; global_step2 (seeded, 256 KiB) is saved with the
interval holding its persist back, so that only the exit persists it. Then the script
returns (HOW=return), raises (raise), or prints READY and sleeps until the test sends
SIGTERM (sigterm) or SIGINT, Ctrl-C (sigint). The credentials come from
AZURE_STORAGE_CONNECTION_STRING.
"""

from __future__ import annotations

import gc
import sys
import time

import torch

import nebulaml as nm


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(1000 + step))}


def main() -> None:
    url, how = sys.argv[1], sys.argv[2]
    nm.init(url, persistent_time_interval=3600, exit_timeout_s=60)
    nm.Checkpoint("global_step1").save("model", state(1))
    nm.flush_persistence()  # also starts the interval: global_step2 is not due for an hour
    nm.Checkpoint("global_step2").save("model", state(2))
    gc.collect()  # a KeyboardInterrupt raised in a collector's callback would be lost
    print("READY", flush=True)
    if how == "raise":
        raise RuntimeError("training failed")
    if how in ("sigterm", "sigint"):
        for _ in range(1200):  # the test sends the signal here; back in Python every
            time.sleep(0.1)  # 0.1 s, as a training loop is, to handle it at once


if __name__ == "__main__":
    main()
