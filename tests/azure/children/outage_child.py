"""A training script whose store goes away under it (test_azure_outage_life.py).

    outage_child.py save URL      global_step1-3 saved and made durable, "DURABLE"; then,
                                  once the test has taken the store away and says so on
                                  stdin, global_step4-5 saved (acknowledged, in RAM only),
                                  "ACKED", and the process kills itself (SIGKILL)
    outage_child.py resume URL    the README's resume: init, the latest checkpoint loaded;
                                  prints one JSON line (tag, the state's digest, seconds
                                  taken in all and by init), then ends as a script does
    outage_child.py exit URL      global_step1 saved and made durable, "READY"; once told
                                  on stdin, global_step2 and (a second later, its persist
                                  in flight) global_step3 saved, then the script ends with
                                  them unpersisted

The credentials come from AZURE_STORAGE_CONNECTION_STRING; `exit_timeout_s` from
NEBULA_EXIT_TIMEOUT_S.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch

import nebulaml as nm


def state(step: int) -> dict[str, torch.Tensor]:
    """256 KiB seeded by the step, and the step."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(1 << 16, generator=g), "step": torch.tensor(step)}


def digest(loaded: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(loaded["w"].numpy().tobytes()).hexdigest()


def save(step: int) -> None:
    nm.Checkpoint(f"global_step{step}").save("model", state(step))


def main() -> None:
    how, url = sys.argv[1], sys.argv[2]
    started = time.monotonic()
    nm.init(url, persistent_time_interval=0)
    init_s = time.monotonic() - started
    if how == "resume":
        latest = nm.get_latest_checkpoint()
        assert latest is not None, "no checkpoint found"
        with latest:
            loaded = latest.load("model")
        took = time.monotonic() - started
        print(json.dumps({"tag": latest.tag, "digest": digest(loaded), "took_s": took,
                          "init_s": init_s}), flush=True)  # fmt: skip
        return
    first = (1, 2, 3) if how == "save" else (1,)
    for step in first:
        save(step)
    nm.flush_persistence(timeout_s=60)
    print("DURABLE" if how == "save" else "READY", flush=True)
    sys.stdin.readline()  # the store is away now
    if how == "exit":
        save(2)
        time.sleep(1)  # global_step2's persist is in flight, hanging or failing
        save(3)
        print("SAVED", flush=True)
        return
    save(4)
    save(5)
    print("ACKED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
