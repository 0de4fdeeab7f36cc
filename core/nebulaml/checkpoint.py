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

import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from nebulaml.errors import CheckpointExistsError, InvalidArgumentError, TooManyItemsError
from nebulaml.format.names import step_of, validate_name
from nebulaml.format.serialization import MapLocation
from nebulaml.protocol.leases import HandleHolds
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime import session as _session
from nebulaml.runtime.load import load_item
from nebulaml.runtime.save import SaveJob

MANUAL_COMMIT = -2


def _release_elsewhere(holds: HandleHolds) -> None:
    """End a dropped handle's holds on a thread of its own. The collector runs a
    finalizer on whichever thread it interrupts, and that may be a network store's event
    loop (fsspec's): a removal waited for there could never be answered, and held every
    request of the process until the call's deadline (30 s). A hold not removed expires."""
    thread = threading.Thread(target=holds.release, name="nebula-release-hold", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # the interpreter is shutting down: the holds expire
        return


class Checkpoint:
    """A handle to the checkpoint `tag`.

    `num_of_files=k > 0` commits by itself after `k` saves (the default, 1, commits after
    the first); `num_of_files=-2` commits only when `commit()` is called. A committed
    tag is not written again unless `overwrite=True`. `labels` (e.g. `["best"]`) are
    recorded in the manifest, and labelled checkpoints are kept by retention.

    With several ranks every rank writes its part of the tag by default, and the tag
    commits once every rank has committed its part. `ranks` (e.g. `[0]`, for the common
    `if rank == 0: save`) names the ranks that write it: it commits once their parts are
    in, and the other ranks need not call anything (their `save` is refused). The job's
    ranks are read at the first save. Two ranks saving an item of one name into a tag is
    an `ItemCollisionError`.

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
        ranks: Iterable[int] | None = None,
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
        self.ranks: tuple[int, ...] | None = _writer_ranks(ranks)
        self._job = SaveJob(self.tag, overwrite=overwrite, labels=self.labels, ranks=self.ranks)
        # A handle from get_checkpoint / get_latest_checkpoint holds its tag (leases.py).
        self._holds: HandleHolds | None = None

    @classmethod
    def _committed_handle(
        cls, tag: str, tiers: TierSet, holds: HandleHolds | None = None
    ) -> Checkpoint:
        handle = cls(tag)
        handle._job.mark_committed(tiers)
        if holds is not None:
            handle._holds = holds
            # Dropped unreleased: its holds go with it (or expire, at exit).
            weakref.finalize(handle, _release_elsewhere, holds).atexit = False
        return handle

    @property
    def step(self) -> int | None:
        """The training step the tag names, None for a tag that names none (`"best"`).

        The rule nebula orders checkpoints by ("latest" is the highest step): the number
        after `global_step` (nebula's and DeepSpeed's tags), else after Lightning's
        `step=`, in ASCII digits. A job resumes its loop from it.

        Example:
            >>> import nebulaml as nm
            >>> nm.Checkpoint("global_step500").step, nm.Checkpoint("epoch=1-step=80").step
            (500, 80)
            >>> nm.Checkpoint("best").step is None
            True
        """
        return step_of(self.tag)

    def release(self) -> None:
        """Let go of the checkpoint: retention and prune may delete it again (a handle
        from `get_checkpoint` or `get_latest_checkpoint` holds it until then, or until
        60 s after its last load). Idempotent; `with handle:` calls it on exit.

        Example:
            >>> import nebulaml as nm, tempfile
            >>> nm.init(tempfile.mkdtemp())
            >>> nm.Checkpoint("global_step1").save("model", {"w": 1})
            >>> with nm.get_latest_checkpoint() as latest:
            ...     latest.load("model")
            {'w': 1}
        """
        if self._holds is not None:
            self._holds.release()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

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
        if self._holds is not None:
            self._holds.renew()  # a handle that is loaded keeps its checkpoint
        return load_item(
            tiers, self.tag, name, map_location=map_location, weights_only=weights_only
        )


def _writer_ranks(ranks: Iterable[int] | None) -> tuple[int, ...] | None:
    """`Checkpoint(ranks=)` checked: distinct ranks (ints, 0 or more), at least one,
    sorted; None (every rank of the job) stays None.

    Example:
        >>> _writer_ranks([2, 0]), _writer_ranks(None)
        ((0, 2), None)
    """
    if ranks is None:
        return None
    why = "must be a list of ranks (ints, 0 or more), at least one, each once"
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise InvalidArgumentError(f"ranks {why}, not {ranks!r}")
    values = tuple(ranks)
    if (
        not values
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in values)
        or len(set(values)) != len(values)
    ):
        raise InvalidArgumentError(f"ranks {why}, not {values!r}")
    return tuple(sorted(values))
