"""The exception tree of nebulaml.

Every failure the library expects (bad input, missing or corrupt checkpoints, storage
faults, a failed background persist) is a `NebulaError`, so callers can catch them all
with one clause. Programming errors inside the library are not wrapped.

Not for: logging or reporting; that is the caller's business.
"""

from __future__ import annotations

from collections.abc import Iterator


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it (`__cause__`, else `__context__`), down the chain, each
    once: what a classifier or a scrubber of a wrapped failure walks.

    Example:
        >>> try:
        ...     try:
        ...         raise OSError("disk")
        ...     except OSError as low:
        ...         raise StorageError("root") from low
        ... except StorageError as exc:
        ...     [type(e).__name__ for e in exception_chain(exc)]
        ['StorageError', 'OSError']
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


class NebulaError(Exception):
    """Base class: `except NebulaError` catches every expected failure.

    Example:
        >>> try:
        ...     raise CheckpointNotFoundError("/ckpt", "global_step5")
        ... except NebulaError as exc:
        ...     print(exc)
        /ckpt: no checkpoint 'global_step5' found
    """


class InvalidArgumentError(NebulaError, ValueError):
    """An argument (a tag, an item name, an option) was refused before any I/O."""


class InvalidNameError(InvalidArgumentError):
    """A tag or item name that could escape its folder or is not a portable file name."""

    def __init__(self, kind: str, name: object, why: str) -> None:
        super().__init__(f"invalid {kind} {name!r}: {why}")
        self.kind, self.name, self.why = kind, name, why


class NotInitializedError(NebulaError, RuntimeError):
    """An API call that needs `nm.init()` (or an explicit `persist_path`) came first."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what}: nebula is not initialised; call nm.init(persistent_storage_path) first "
            "or pass persist_path="
        )


class CheckpointNotFoundError(NebulaError, FileNotFoundError):
    """No committed checkpoint (or no such tag) at a root."""

    def __init__(self, root: str, tag: str | None = None) -> None:
        what = f"checkpoint {tag!r}" if tag else "committed checkpoint"
        super().__init__(f"{root}: no {what} found")
        self.root, self.tag = root, tag


class RootNotFoundError(CheckpointNotFoundError):
    """A checkpoint root that exists on no tier (neither the path nor its memory tier)."""

    def __init__(self, root: str, why: str | None = None) -> None:
        said = f"{root}: no such checkpoint root" + (f" ({why})" if why else "")
        NebulaError.__init__(self, said)
        self.root, self.tag = root, None


class ItemNotFoundError(NebulaError, LookupError):
    """A committed checkpoint exists but holds no item of that name."""

    def __init__(self, tag: str, name: str, available: list[str]) -> None:
        listed = ", ".join(repr(n) for n in available) or "none"
        super().__init__(f"checkpoint {tag!r} has no item {name!r}; its items: {listed}")
        self.tag, self.name, self.available = tag, name, available


class CheckpointExistsError(NebulaError, FileExistsError):
    """A committed tag would be written again without `overwrite=True`."""

    def __init__(self, where: str, tag: str, *, hint: str | None = None) -> None:
        hint = hint or f"use a new tag, or nm.Checkpoint({tag!r}, overwrite=True) to replace it"
        super().__init__(f"{where}: checkpoint {tag!r} is already committed; {hint}")
        self.where, self.tag = where, tag


class CheckpointBusyError(NebulaError):
    """A live process is writing (or reading) the tag; replacing it now would corrupt that."""

    def __init__(self, where: str, tag: str, writer: str, *, activity: str = "written") -> None:
        super().__init__(
            f"{where}: checkpoint {tag!r} is being {activity} by {writer}; wait for it to "
            f"finish (or stop that process), then try again"
        )
        self.where, self.tag, self.writer = where, tag, writer


class RootInUseError(NebulaError, RuntimeError):
    """Another live job holds the root: one job writes a root at a time (ranks of one job
    share it). `holder` says who ("job ... (pid 12 on node1, since ...)")."""

    def __init__(self, where: str, holder: str, *, hint: str = "") -> None:
        super().__init__(
            f"{where}: held by another job, {holder}; one job writes a root at a time: "
            f"end that job or wait for it, or give this job another root{hint}"
        )
        self.where, self.holder = where, holder


class CommitConflictError(NebulaError, FileExistsError):
    """Another writer committed the same tag first (create-only manifest lost the race)."""

    def __init__(self, where: str, tag: str) -> None:
        super().__init__(f"{where}: checkpoint {tag!r} was committed by another writer first")
        self.where, self.tag = where, tag


class ItemCollisionError(CommitConflictError):
    """Two ranks saved an item of the same name into one checkpoint: it is never committed
    with an item twice."""

    def __init__(self, where: str, tag: str, name: str, first: int, second: int) -> None:
        NebulaError.__init__(
            self,
            f"{where}: item {name!r} of checkpoint {tag!r} is saved by rank {first} and by "
            f"rank {second}; each item is one rank's. Save it on one rank only "
            f"(nm.Checkpoint({tag!r}, ranks=[{first}]) is a checkpoint that rank {first} "
            f"alone writes), or give each rank's item its own name",
        )
        self.where, self.tag, self.name, self.ranks = where, tag, name, (first, second)


class CheckpointStateError(NebulaError, RuntimeError):
    """A Checkpoint handle was used out of order (e.g. saving into a committed handle)."""


class SnapshotChangedError(CheckpointStateError):
    """A lazy save's tensor was changed in place before the background copy had read it:
    the snapshot would mix two states, so the checkpoint is not committed."""

    def __init__(self, tag: str, name: str, paths: list[str]) -> None:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        super().__init__(
            f"checkpoint {tag!r} was not committed: item {name!r} had {shown} changed in "
            f"place after save() and before its lazy copy (only optimizer.step() waits for "
            f"the copy); call nm.wait_for_snapshot() before changing saved tensors outside "
            f"the optimizer, or init nebula with lazy_snapshot=False"
        )
        self.tag, self.name, self.paths = tag, name, paths


class TooManyItemsError(CheckpointStateError):
    """More items were saved than the `num_of_files` the handle was created with."""

    def __init__(self, tag: str, num_of_files: int) -> None:
        super().__init__(
            f"checkpoint {tag!r} was opened with num_of_files={num_of_files} and is already "
            f"committed; create it with a larger num_of_files, or num_of_files=-2 and call "
            f"commit() yourself"
        )
        self.tag, self.num_of_files = tag, num_of_files


class ManifestError(NebulaError):
    """A manifest.json that cannot be trusted: unreadable, invalid, or of an unknown schema."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


class UnsupportedSchemaError(ManifestError):
    """A manifest written by a newer (or unknown) nebula; never skipped silently.
    `written_by`: the nebula version the manifest names as its producer, which reads it
    (None when it names none); `tag`: the checkpoint's, where the reader knows it."""

    def __init__(
        self,
        where: str,
        version: object,
        supported: tuple[int, ...],
        written_by: str | None = None,
    ) -> None:
        reader = f"nebula {written_by}, which wrote it," if written_by else "a newer nebula"
        super().__init__(
            where,
            f"manifest schema_version {version!r} is not supported (this nebula reads "
            f"{', '.join(map(str, supported))}; {reader} reads it); upgrade "
            "nebula-checkpoint to read it",
        )
        self.version, self.written_by = version, written_by
        self.tag: str | None = None


class CorruptCheckpointError(NebulaError):
    """An item's bytes do not match the size or checksum its manifest recorded."""

    def __init__(self, file: str, expected: str, actual: str) -> None:
        super().__init__(f"{file}: corrupt item, expected {expected}, found {actual}")
        self.file, self.expected, self.actual = file, expected, actual


class UnsafeCheckpointError(NebulaError):
    """Loading an item would execute code from its pickle; refused under weights_only=True."""

    def __init__(self, file: str, detail: str) -> None:
        super().__init__(
            f"{file}: loading this item needs code execution, refused with weights_only=True "
            f"({detail}). If you trust this checkpoint, load it with weights_only=False, or "
            f"allow its classes with torch.serialization.add_safe_globals([...])"
        )
        self.file, self.detail = file, detail


class StorageError(NebulaError, OSError):
    """A storage backend failed; the backend's exception is chained as `__cause__`."""


class StorageFullError(StorageError):
    """The storage ran out of space (ENOSPC or a quota)."""


class StoreTimeoutError(StorageError, TimeoutError):
    """A store did not answer a call within its deadline (a suspended server, a half-open
    connection, a stuck network mount): like a store that is down, it may pass."""


class UnsafeMemoryTierError(StorageError):
    """A memory-tier folder that is not this user's alone (another owner, a symbolic link,
    writable by others, not a folder): nebula neither writes nor deletes through it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(
            f"{path}: {why}; nebula refuses to use it as a memory tier (remove it, or set "
            f"NEBULA_MEMORY_TIER_PATH to a folder of your own)"
        )
        self.path, self.why = path, why


class PersistError(NebulaError):
    """A background persist failed; raised on the next call into the library."""

    def __init__(self, tag: str, root: str, cause: BaseException) -> None:
        super().__init__(f"persisting checkpoint {tag!r} to {root} failed: {cause}")
        self.tag, self.root = tag, root


class RankTimeoutError(NebulaError, TimeoutError):
    """Some ranks did not write their part of a checkpoint in time (one may have died)."""

    def __init__(
        self,
        where: str,
        missing: list[int],
        timeout_s: float,
        stale: list[int] | None = None,
        wrote: list[int] | None = None,
        tag: str | None = None,
    ) -> None:
        def listed(ranks: list[int]) -> str:
            return ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")

        older = ""
        if stale:
            older = (
                f" (the part of rank(s) {listed(stale)} there is from another run or restart "
                f"of the job: never committed with this one's)"
            )
        did = f"; rank(s) {listed(wrote)} did" if wrote else ""
        hint = "Raise NEBULA_RANK_TIMEOUT_S if ranks are just slow"
        if wrote and not stale:
            # Only some ranks saved: the common `if rank == 0: save` without saying so.
            hint = (
                f"If only rank(s) {listed(wrote)} save this checkpoint, say so: "
                f"nm.Checkpoint({tag or 'tag'!r}, ranks=[{', '.join(map(str, wrote[:16]))}]). "
                f"Raise NEBULA_RANK_TIMEOUT_S if ranks are just slow"
            )
        super().__init__(
            f"{where}: rank(s) {listed(missing)} did not commit their part within "
            f"{timeout_s:g} s{older}{did}; the checkpoint stays uncommitted (a rank may have "
            f"died; the previous checkpoint still loads). {hint}"
        )
        self.where, self.missing, self.timeout_s = where, missing, timeout_s
        self.stale = stale or []
        self.wrote = wrote or []


class RankGoneError(RankTimeoutError):
    """A rank that writes part of a checkpoint ended without writing it (its process on
    this node is gone): the checkpoint cannot be committed, and nothing waits for it."""

    def __init__(self, where: str, gone: list[int], tag: str | None = None) -> None:
        NebulaError.__init__(
            self,
            f"{where}: rank(s) {', '.join(map(str, gone[:16]))} ended without their part "
            f"there (the process is gone); the checkpoint stays uncommitted (the previous "
            f"checkpoint still loads)",
        )
        self.where, self.missing, self.timeout_s = where, gone, 0.0
        self.stale: list[int] = []
        self.wrote: list[int] = []
        self.tag = tag


class PartSupersededError(RankTimeoutError):
    """Another rank saved the tag again (`overwrite=True`) before this part of an earlier
    save of it was committed: its part of that save is gone, so this one can never be
    committed, and nothing waits for it (this rank's own save of it again follows)."""

    def __init__(self, where: str, ranks: list[int], tag: str | None = None) -> None:
        NebulaError.__init__(
            self,
            f"{where}: rank(s) {', '.join(map(str, ranks[:16]))} saved it again before "
            f"this part of an earlier save of it was committed; that save is abandoned "
            f"(the newer one is persisted instead)",
        )
        self.where, self.missing, self.timeout_s = where, ranks, 0.0
        self.stale: list[int] = list(ranks)
        self.wrote: list[int] = []
        self.tag = tag


class PersistTimeoutError(NebulaError, TimeoutError):
    """A wait for the persister (flush, exit) ran past its limit."""


class MemoryBudgetError(NebulaError, MemoryError):
    """A checkpoint does not fit the memory tier's budget and has nowhere else to go."""

    def __init__(self, tag: str, need_bytes: int, limit_bytes: int, why: str) -> None:
        super().__init__(
            f"checkpoint {tag!r} needs {need_bytes} bytes in the memory tier, over its budget "
            f"of {limit_bytes} bytes (NEBULA_MEMORY_BUFFER_SIZE), and {why}. Raise "
            f"NEBULA_MEMORY_BUFFER_SIZE, or give nm.init() a persistent_storage_path"
        )
        self.tag, self.need_bytes = tag, need_bytes
        self.limit_bytes: int | None = limit_bytes


class MemoryTierFullError(MemoryBudgetError):
    """A checkpoint does not fit the free space of the memory tier's filesystem (a small
    /dev/shm) and has nowhere else to go."""

    def __init__(self, tag: str, need_bytes: int, free_bytes: int, path: str, why: str) -> None:
        NebulaError.__init__(
            self,
            f"checkpoint {tag!r} needs {need_bytes} bytes in the memory tier, and its "
            f"filesystem ({path}) has {free_bytes} bytes free, and {why}: "
            f"{memory_tier_advice(need_bytes)}, or give nm.init() a persistent_storage_path",
        )
        self.tag, self.need_bytes = tag, need_bytes
        self.limit_bytes = None
        self.free_bytes, self.path = free_bytes, path


def memory_tier_advice(checkpoint_bytes: int) -> str:
    """How to give the memory tier room for checkpoints of `checkpoint_bytes` (two copies:
    the newest and the one being written)."""
    gib = max(1, -(-2 * checkpoint_bytes // (1 << 30)))
    return (
        f"give the memory tier room for two copies: `docker run --shm-size={gib}g ...` "
        f"(Docker's /dev/shm is 64 MiB), or NEBULA_MEMORY_TIER_PATH set to a folder on a "
        f"local NVMe disk"
    )
