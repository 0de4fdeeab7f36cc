"""A rendezvous for the ranks a test launches, on a port nothing else can take: the test's
own process serves the store (torch's TCPStore, bound to port 0: the OS picks a free port
and it stays bound), and every rank connects to it as a client, as under torchrun's agent
(`TORCHELASTIC_USE_AGENT_STORE`). Probing for a free port and handing it to a child that
binds it later is a race another process can win.

Not for: torchrun jobs (`--standalone` binds its own store the same way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def rendezvous(world_size: int) -> Iterator[dict[str, str]]:
    """A store served for `world_size` ranks while the block runs; yields the environment
    that points env:// and tcp:// process groups (and nebula's job identity) at it.

    Example (not run here: it starts a server):
        with rendezvous(2) as env: launch two ranks with os.environ | env
    """
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, multi_tenant=True
    )
    try:
        yield {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    finally:
        del store
