"""`Checkpoint`: the seed's handle to one tag, for saving items and loading them back.

Saving snapshots each object into the memory tier and returns once the caller may mutate
it again; committing publishes the manifest there and hands the tag to the persister.
Loading reads the fastest tier that holds the tag, verifies size and checksum before
anything is unpickled, and falls back to another tier's copy on a mismatch.

The handle checks each call, then hands it over: the save and commit to
runtime/save.py (`SaveJob`), the load to runtime/load.py.

May import: every layer below the public API. Not for: the save and load pipelines
(runtime/save.py, runtime/load.py), listing checkpoints (api.py), or process-wide
configuration (config.py, runtime/session.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from nebulaml.errors import CheckpointExistsError, InvalidArgumentError, TooManyItemsError
from nebulaml.format.names import validate_name
from nebulaml.format.serialization import MapLocation
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime import session as _session
from nebulaml.runtime.load import load_item
from nebulaml.runtime.save import SaveJob

MANUAL_COMMIT = -2


class Checkpoint:
    """A handle to the checkpoint `tag`.

    `num_of_files=k > 0` commits by itself after `k` saves (the default, 1, commits after
    the first); `num_of_files=-2` commits only when `commit()` is called. A committed
    tag is not written again unless `overwrite=True`. `labels` (e.g. `["best"]`) are
    recorded in the manifest, and labelled checkpoints are kept by retention.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.init(tempfile.mkdtemp(), persistent_time_interval=0)
        >>> ckpt = nm.Checkpoint("global_step5", 2)
        >>> ckpt.save("model", {"w": 1})
        >>> ckpt.save("optimizer", {"lr": 0.1})   # the second save commits
        >>> nm.get_latest_checkpoint().load("optimizer")
        {'lr': 0.1}
    """

    def __init__(
        self,
        tag: str,
        num_of_files: int = 1,
        *,
        overwrite: bool = False,
        labels: Iterable[str] = (),
    ) -> None:
        self.tag: str = validate_name("tag", tag)
        if not isinstance(num_of_files, int) or isinstance(num_of_files, bool) or num_of_files == 0:
            raise InvalidArgumentError(
                f"num_of_files must be a positive int (commit after that many saves) or "
                f"{MANUAL_COMMIT} (commit on commit()), not {num_of_files!r}"
            )
        self.num_of_files = num_of_files
        self.overwrite = overwrite
        self.labels: tuple[str, ...] = tuple(validate_name("label", x) for x in labels)
        # The save of this tag (runtime/save.py); it also holds the tiers the tag is on,
        # bound by the first save, or by get_checkpoint.
        self._job = SaveJob(self.tag, overwrite=overwrite, labels=self.labels)

    @classmethod
    def _committed_handle(cls, tag: str, tiers: TierSet) -> Checkpoint:
        handle = cls(tag)
        handle._job.mark_committed(tiers)
        return handle

    def __repr__(self) -> str:
        job = self._job
        state = "committed" if job.committed else f"{len(job.items)} item(s) saved"
        return f"Checkpoint({self.tag!r}, {state})"

    # saving --------------------------------------------------------------------------
    def save(self, name: str, obj: Any) -> None:
        """Snapshot `obj` as the item `name`; `obj` may be mutated once this returns.

        Modules, optimizers and other objects with `state_dict()` are saved as their
        state dict, so every item loads with `torch.load(path, weights_only=True)`.
        """
        # A lazy save queues behind the earlier ones rather than waiting for them.
        session = _session.current("Checkpoint.save", fence=False)
        session.persister.raise_pending_error()
        validate_name("item", name)
        t0 = time.perf_counter()
        job = self._job
        if job.committed or job.sealed:
            if self.num_of_files > 0 and job.names:
                raise TooManyItemsError(self.tag, self.num_of_files)
            raise CheckpointExistsError(session.tiers.display, self.tag)
        if name in job.names:
            raise InvalidArgumentError(f"checkpoint {self.tag!r} already has an item {name!r}")
        job.add(session, name, obj, t0)
        if self.num_of_files > 0 and len(job.names) == self.num_of_files:
            self.commit()

    def commit(self) -> bool:
        """Commit the saved items in the memory tier and queue the persist; returns True.

        Committing twice, or a handle with nothing saved, is a no-op.
        """
        if self._job.committed or self._job.sealed:
            return True
        # A pending background failure is left for the next call: the items are written,
        # and the checkpoint must not be lost to an older persist's error.
        session = _session.current("Checkpoint.commit", raise_pending=False, fence=False)
        return self._job.commit(session)

    # loading -------------------------------------------------------------------------
    def load(
        self,
        name: str,
        map_location: MapLocation = None,
        weights_only: bool | None = True,
    ) -> Any:
        """Load the item `name` of this committed checkpoint.

        Reads the fastest tier that holds it and verifies size and checksum before
        unpickling; on a mismatch it tries the next tier, else raises
        `CorruptCheckpointError`. With `weights_only=True` (the default; None means True)
        a pickle that would execute code raises `UnsafeCheckpointError`. Each copy is read
        under a read lease (leases.py): no prune, retention or eviction deletes it meanwhile.
        """
        validate_name("item", name)
        tiers = self._job.tiers
        if tiers is None:
            tiers = _session.current("Checkpoint.load").tiers
        else:
            _session.current_or_none()
        return load_item(
            tiers, self.tag, name, map_location=map_location, weights_only=weights_only
        )
