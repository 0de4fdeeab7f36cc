"""A backend from outside nebula: tests/plugins/demo_backend.py, installed as a
distribution would be (its module and a `.dist-info` declaring the `nebulaml.backends`
entry point `demo`, on a child process's path), is found through the entry point alone,
passes nebula's backend contract (`nebulaml.testing`), and carries a checkpoint from
`nm.init("demo://...")` to a load; core/ knows nothing of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import json, uuid
import torch
import nebulaml as nm
from nebulaml.backends import registered_protocols
from nebulaml.testing import run_contract

passed = run_contract(lambda: f"demo://bucket/{uuid.uuid4().hex[:8]}")
root = "demo://bucket/run1"
nm.init(root, persistent_time_interval=0)
nm.Checkpoint("global_step1", 1).save("model", {"w": torch.arange(8.0)})
assert nm.flush_persistence()
nm.shutdown()
listed = nm.list_checkpoints(root)
loaded = nm.get_latest_checkpoint(root).load("model")["w"].tolist()
print(json.dumps({"protocols": registered_protocols(), "passed": passed,
                  "tiers": [c["tiers"] for c in listed], "loaded": loaded}))
"""


def _install(site: Path) -> None:
    """The plugin as pip would leave it in site-packages: its module and its metadata."""
    site.mkdir()
    shutil.copy(HERE / "demo_backend.py", site / "demo_backend.py")
    info = site / "nebula_demo_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nebula-demo-backend\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text("[nebulaml.backends]\ndemo = demo_backend:open_demo\n")


def _child(site: Path | None, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    env["NEBULA_MEMORY_TIER_PATH"] = str(tmp_path / "memory-tiers")
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)  # fmt: skip


def test_a_plugin_installed_by_entry_point_passes_the_contract(tmp_path: Path) -> None:
    # Catches: entry points never read (the demo:// root an unknown fsspec protocol), a
    # contract the plugin passes only with nebula's own backends, or a session that needs
    # a backend nebula knows by class.
    _install(tmp_path / "site")
    done = _child(tmp_path / "site", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "demo" in out["protocols"]
    assert len(out["passed"]) == 9
    # The demo backend has no `list_prefixed` of its own (it predates it): Store lists its
    # folder whole and filters (the hold check of its root, in the checkpoint below, too).
    assert "check_prefixed_listing" in out["passed"]
    assert out["tiers"] == [["persistent"]] and out["loaded"] == [float(i) for i in range(8)]


def test_without_the_plugin_a_demo_root_is_refused(tmp_path: Path) -> None:
    # The same child without the distribution: the protocol is nobody's.
    done = _child(None, tmp_path)
    assert done.returncode != 0 and "demo" in done.stderr
