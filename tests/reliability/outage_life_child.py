"""The training script of the outage campaign's restart and exit rounds (outages.py, and
tests/azure/test_azure_outage_life.py), whose store goes away under it.

    outage_life_child.py save ROOT JOURNAL     global_step1-3 saved and made durable,
        "DURABLE"; then, once told on stdin (the store is away), global_step4, 5, ...
        saved 0.05 s apart, each journalled (fsynced: acknowledged) once its save
        returned, until the campaign SIGKILLs the process
    outage_life_child.py resume ROOT JOURNAL   the README's resume: init, the latest
        checkpoint loaded, one JSON line (its tag, the loaded state's digest, the seconds
        from before init to loaded, and those init took); then one more step saved and
        journalled, "ACKED";
        once told "flush" on stdin (the store is back), flushed: "FLUSHED True|False"
    outage_life_child.py exit ROOT JOURNAL N   global_step1 saved and made durable,
        "READY"; once told, global_step2..N+1 saved, "SAVED <tag>", and the script ends
        with the newest unpersisted
    outage_life_child.py recover ROOT JOURNAL  the next start on this node once the store
        is back: init, flushed, "FLUSHED True|False"

The state is a function of the step (256 KiB seeded by it, and the step), so that the
campaign can check any checkpoint bit for bit (`digest(state(step))`). `exit_timeout_s`
comes from NEBULA_EXIT_TIMEOUT_S, the store's credentials and deadlines from the
environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

import nebulaml as nm


def state(step: int) -> dict[str, torch.Tensor]:
    """256 KiB seeded by the step, and the step."""
    g = torch.Generator().manual_seed(4300 + step)
    return {"w": torch.randn(1 << 16, generator=g), "step": torch.tensor(step)}


def digest(loaded: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(loaded["w"].numpy().tobytes())
    h.update(str(int(loaded["step"])).encode())
    return h.hexdigest()[:16]


def _save(step: int, journal: str | None = None) -> None:
    saved = state(step)
    nm.Checkpoint(f"global_step{step}").save("model", saved)
    if journal is not None:  # acknowledged: the save returned
        with open(journal, "a") as out:
            out.write(json.dumps({"step": step, "digest": digest(saved)}) + "\n")
            out.flush()
            os.fsync(out.fileno())


def main() -> None:
    how, root, journal = sys.argv[1], sys.argv[2], sys.argv[3]
    started = time.monotonic()
    nm.init(root, persistent_time_interval=0, num_of_version_in_retention=2)
    init_s = time.monotonic() - started
    if how == "resume":
        latest = nm.get_latest_checkpoint()
        assert latest is not None, "no checkpoint found"
        with latest:
            loaded = latest.load("model")
        took = time.monotonic() - started
        print(json.dumps({"tag": latest.tag, "digest": digest(loaded), "took_s": took,
                          "init_s": init_s}), flush=True)  # fmt: skip
        _save(int(loaded["step"]) + 1, journal)  # training goes on, in RAM only
        print("ACKED", flush=True)
        if sys.stdin.readline().strip() == "flush":
            print("FLUSHED", nm.flush_persistence(timeout_s=120, raise_on_error=False),
                  flush=True)  # fmt: skip
        return
    if how == "recover":
        print("FLUSHED", nm.flush_persistence(timeout_s=120, raise_on_error=False), flush=True)
        return
    for step in (1, 2, 3) if how == "save" else (1,):
        _save(step)
    assert nm.flush_persistence(timeout_s=60), "not durable before the outage"
    print("DURABLE" if how == "save" else "READY", flush=True)
    sys.stdin.readline()  # the store is away now
    if how == "exit":
        last = 1 + int(sys.argv[4])
        for step in range(2, last + 1):
            _save(step, journal)
        print(f"SAVED global_step{last}", flush=True)
        return  # the script ends, its newest checkpoint unpersisted
    for step in range(4, 200):
        _save(step, journal)
        time.sleep(0.05)
    sys.exit(3)  # never reached: the campaign kills it first


if __name__ == "__main__":
    main()
