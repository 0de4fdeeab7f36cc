"""One incoming replica of another node's checkpoint part, written into this node's memory
tier as its bytes arrive, checked file by file, and committed only whole (the layout and
what is kept: protocol/replicas.py).

    ReplicaInbox     one incoming replica: `feed` its bytes, `finish` (commit or refuse),
                     `withdraw` (the sender gave it up), `abandon` (its link failed)
    check_reuse      whether the runs announced can be taken from a base replica
    Outcome          what became of it

A replica is *whole* when its `.replica.json` is there, valid, and every file it lists is
there with its size. The sender announces each file (`FileClaim`: name, size, checksum);
`ReplicaInbox` writes the files as their bytes arrive, hashing each on the way, and
refuses the replica (removes it, says why in one warning) when a file's bytes do not
match its claim, when the claims of the items are not what the marker records for them
(nor, with a manifest, what the manifest records), or when fewer bytes arrive than
announced. Only then is `.replica.json` written.

**Built on the replica held.** A sender may announce a *base*, the whole replica of an
older tag this node holds of the same rank, and for each item the runs (offset, length)
to take from that replica's file of the same name: only the other bytes arrive
(runtime/replica_delta.py decides which). The inbox copies each run from the base's file
as the file's bytes come to it, and hashes every byte of the new file, copied or
received, against its claim: a base whose bytes are not what the sender thinks (a byte
flipped in this node's memory) makes a file that does not match, and the replica is
refused like any other; so is one whose base is not here whole. The base stays until the
new replica is whole. A sender that gives a replica up (its part was saved again while
it was sent) ends it with `withdraw`: what was written goes, quietly.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage` and
protocol/replicas.py. Not for: moving the bytes between nodes (runtime/replication.py),
what of a replica is sent (runtime/replica_delta.py), or which replicas are kept
(protocol/replicas.py `keep_only`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import ManifestError, NebulaError
from nebulaml.format.checksum import new_hasher
from nebulaml.format.manifest import RankMarker, parse_manifest, parse_marker, utc_now
from nebulaml.format.names import MANIFEST_NAME, REPLICA_DONE, marker_name, validate_name
from nebulaml.protocol.inbox import FileInbox
from nebulaml.protocol.replicas import (
    DONE_SCHEMA_VERSION,
    FileClaim,
    OwnParts,
    check_claims,
    keep_only,
    read_replica,
    remove_replica,
)
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

MAX_RUNS = 1 << 18  # runs taken from a base, in one announcement: a few MiB of JSON
_COPY_BYTES = 8 << 20  # a run is copied from the base's file this much at a time

Runs = Mapping[str, Sequence[tuple[int, int]]]  # item file: (offset, length) from the base


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one incoming replica: `committed`, or refused for `reason`.
    `kept`: an identical whole replica was there already, and stays."""

    tag: str
    rank: int
    committed: bool
    reason: str | None = None
    kept: bool = False
    withdrawn: bool = False  # its sender gave it up (not a refusal)


def check_reuse(tag: str, files: Sequence[FileClaim], base: str | None, runs: Runs) -> str | None:
    """Why the `runs` announced to take from the replica of `base` cannot be (None: they
    can): a base that is the tag itself or no tag, runs without a base, of a file not
    announced or not an item, out of order, overlapping, empty or past the file's end.

    Example:
        >>> files = [FileClaim(".rank-0.json", 9, "xxh3_64_tree_1m", "0"),
        ...          FileClaim("model", 100, "xxh3_64_tree_1m", "0")]
        >>> check_reuse("s2", files, "s1", {"model": [(0, 10), (50, 50)]}) is None
        True
        >>> check_reuse("s2", files, "s1", {"model": [(50, 51)]})
        'model: runs out of order, overlapping or past its 100 bytes'
    """
    if base is None:
        return "runs announced without a base replica" if runs else None
    if base == tag:
        return "a replica announced as built on itself"
    try:
        validate_name("tag", base)
    except ValueError as exc:
        return f"an unsafe base tag: {exc}"
    sizes = {claim.name: claim.size for claim in files}
    if sum(len(r) for r in runs.values()) > MAX_RUNS:
        return f"more than {MAX_RUNS} runs from its base"
    for name, file_runs in runs.items():
        if name not in sizes or name.startswith(".") or name == MANIFEST_NAME:
            return f"runs of {name!r}, which is no item announced"
        at = 0
        for offset, length in file_runs:
            if offset < at or length < 1 or offset + length > sizes[name]:
                return f"{name}: runs out of order, overlapping or past its {sizes[name]} bytes"
            at = offset + length
    return None


class ReplicaInbox(FileInbox):
    """One incoming replica of `rank`'s part of `tag` (from node `node`) into `root`
    (`replica_root`): `feed` it the files' bytes in the order of `files`, in pieces of any
    size, then `finish`. Nothing raises on the way: the first problem is kept, the bytes
    after it are taken and dropped (the sender's stream goes on), and `finish` refuses the
    replica for it.

    With `base` (an older tag whose whole replica of `rank`'s part `root` holds), the
    runs `reuse[name]` of each item file are taken from that replica's file of the same
    name, and `feed` brings only the other bytes, in file order (`total` of them).
    `own`: the receiving rank's own parts (`keep_only` keeps an older replica while its
    own part of this tag is not committed). `pause`, when given, is called before each
    piece of work (each message taken, each `_COPY_BYTES` copied from the base): it may
    wait, so that the copy runs between the training thread's saves."""

    def __init__(
        self,
        root: Store,
        *,
        tag: str,
        rank: int,
        node: int,
        files: Sequence[FileClaim],
        base: str | None = None,
        reuse: Runs | None = None,
        own: OwnParts | None = None,
        pause: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        self.root, self.tag, self.rank, self.node = root, tag, rank, node
        self.own = own
        self._pause = pause
        self.files = tuple(files)
        self.base = base
        self.reuse = {name: tuple(runs) for name, runs in (reuse or {}).items()}
        taken = sum(length for runs in self.reuse.values() for _, length in runs)
        self.total = max(0, sum(max(0, claim.size) for claim in self.files) - taken)
        self.received = 0
        self._error = check_claims(tag, rank, self.files) or check_reuse(
            tag, self.files, base, self.reuse
        )
        self._index = 0  # the file the next byte belongs to
        self._filled = 0  # its bytes written so far
        self._run = 0  # the next of its runs from the base
        self._hasher: Any = None
        self._source: contextlib.ExitStack | None = None  # the base's file, mapped
        self._source_view: memoryview | None = None
        self._small: dict[str, bytearray] = {}  # the marker's and the manifest's bytes
        self._kept = False  # an identical whole replica is there: the bytes are dropped
        self._marker: RankMarker | None = None
        self._mine = False  # the tag folder is this inbox's to write and remove
        if self._error is None:
            self._guard(self._prepare)
        if self._error is None:
            self._guard(self._advance)

    def _prepare(self) -> None:
        held = read_replica(self.root, self.tag)
        if held is not None and held.rank == self.rank and held.files == self.files:
            self._kept = True
            return
        if self.base is not None:
            base = read_replica(self.root, self.base)
            sizes = {} if base is None or base.rank != self.rank else base.sizes
            for name, runs in self.reuse.items():
                end = runs[-1][0] + runs[-1][1] if runs else 0
                if sizes.get(name, -1) < end:
                    self._fail(f"its base, {self.base!r}, is not a whole replica here")
                    return
        remove_replica(self.root, self.tag)  # a replica of a tag saved again, or leftovers
        self._mine = True
        self.root.make_dir(self.tag)

    def _close_current(self, *, failed: bool = False) -> None:
        source, self._source, self._source_view = self._source, None, None
        if source is not None:
            source.close()
        super()._close_current(failed=failed)

    def _open_current(self) -> None:
        claim = self.files[self._index]
        self._open_writer(self.root, self.tag, claim.name)
        self._hasher = new_hasher(claim.algo)
        self._run = 0
        if claim.name in (marker_name(self.rank), MANIFEST_NAME):
            self._small[claim.name] = bytearray()

    def _advance(self) -> None:
        """Take the runs from the base that start where the current file is, close and
        check the file when it is complete, and so on with the files after it (an empty
        item, or one taken whole from the base, needs no byte of the stream)."""
        while self._index < len(self.files) and self._error is None and not self._kept:
            claim = self.files[self._index]
            runs = self.reuse.get(claim.name, ())
            if self._run < len(runs) and runs[self._run][0] == self._filled:
                if self._out is None:
                    self._open_current()
                self._copy_from_base(claim.name, *runs[self._run])
                self._run += 1
                continue
            if self._filled < claim.size:
                return
            if self._out is None:
                self._open_current()  # an empty file
            self._close_current()
            digest = self._hasher.hexdigest()
            if digest != claim.checksum:
                built = " (built on its base, whose bytes are not the sender's)" if runs else ""
                self._fail(
                    f"{claim.name}: {claim.size} bytes with {claim.algo} {digest}, "
                    f"not {claim.checksum} as announced{built}"
                )
                return
            self._index += 1
            self._filled = 0

    def _copy_from_base(self, name: str, offset: int, length: int) -> None:
        """Write the run (`offset`, `length`) of the base's file `name` into the current
        file, hashing it as the bytes received are."""
        assert self.base is not None  # runs come with a base (check_reuse)
        if self._source is None:
            stack = contextlib.ExitStack()
            view = stack.enter_context(self.root.map_read(self.base, name))
            self._source, self._source_view = stack, view
        source = self._source_view
        if source is None or len(source) < offset + length:
            raise MissingFileError(f"{self.root.display(self.base, name)}: shorter than its runs")
        out = self._out
        assert out is not None  # opened first
        for at in range(offset, offset + length, _COPY_BYTES):
            if self._pause is not None:
                self._pause()
            piece = source[at : min(at + _COPY_BYTES, offset + length)]
            self._hasher.update(piece)
            out.write(piece)
        self._filled += length

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the files, in order."""
        view = memoryview(data).cast("B")
        if self._pause is not None:
            self._pause()
        self.received += len(view)
        if self.received > self.total:
            self._fail(f"more bytes than the {self.total} announced")
        if self._error is not None or self._kept:
            return
        try:
            self._write(view)
        except NebulaError as exc:
            self._fail(f"it could not be written: {exc}")

    def _write(self, view: memoryview) -> None:
        while view and self._error is None and self._index < len(self.files):
            claim = self.files[self._index]
            if self._out is None:
                self._open_current()
            runs = self.reuse.get(claim.name, ())
            upto = runs[self._run][0] if self._run < len(runs) else claim.size
            piece = view[: upto - self._filled]
            if not piece:  # never: `_advance` took the run that starts here
                self._fail(f"{claim.name}: no byte to take at {self._filled}")
                return
            self._hasher.update(piece)
            out = self._out
            assert out is not None  # opened first
            out.write(piece)
            small = self._small.get(claim.name)
            if small is not None:
                small += piece
            self._filled += len(piece)
            view = view[len(piece) :]
            self._advance()

    def finish(self, sender_ok: bool = True) -> Outcome:
        """Commit the replica if every byte arrived and matched, else remove it; said in
        one warning when refused. `sender_ok`: the sender read every file whole."""
        if self.received < self.total:
            self._fail(f"{self.received} of {self.total} bytes arrived")
        elif self._index < len(self.files) and not self._kept:
            self._fail(f"{self.files[self._index].name} did not arrive whole")
        if not sender_ok:
            self._fail("its sender could not read the part whole (evicted meanwhile?)")
        if self._error is None and not self._kept:
            self._fail_on(self._check_documents())
        if self._error is None and not self._kept:
            self._guard(self._commit)
        if self._error is not None:
            if self._mine:
                remove_replica(self.root, self.tag)
            log.warning(
                "replica of rank %d's part of %r (from node %d) refused: %s",
                self.rank, self.tag, self.node, self._error,
            )  # fmt: skip
            return Outcome(self.tag, self.rank, committed=False, reason=self._error)
        keep_only(self.root, self.tag, own=self.own)
        return Outcome(self.tag, self.rank, committed=True, kept=self._kept)

    def abandon(self) -> None:
        """The stream ended before the replica did (its link failed): what was written of
        it goes, and an identical replica held already stays."""
        self._fail("its transfer was cut short")
        if self._mine:
            remove_replica(self.root, self.tag)

    def withdraw(self) -> Outcome:
        """Its sender gave the replica up (the part was saved again while it was sent):
        what was written of it goes, without a warning; the replicas held stay."""
        self._fail("withdrawn by its sender")
        if self._mine:
            remove_replica(self.root, self.tag)
        log.debug("replica of rank %d's part of %r withdrawn by its sender", self.rank, self.tag)
        return Outcome(self.tag, self.rank, committed=False, reason=self._error, withdrawn=True)

    def _fail_on(self, reason: str | None) -> None:
        if reason is not None:
            self._fail(reason)

    def _check_documents(self) -> str | None:
        """Why the marker (and manifest) received do not vouch for the items received."""
        name = marker_name(self.rank)
        try:
            marker = parse_marker(bytes(self._small[name]), self.root.display(self.tag, name))
            manifest = None
            if MANIFEST_NAME in self._small:
                where = self.root.display(self.tag, MANIFEST_NAME)
                manifest = parse_manifest(bytes(self._small[MANIFEST_NAME]), where)
        except ManifestError as exc:
            return str(exc)
        self._marker = marker
        if marker.tag != self.tag or marker.rank != self.rank:
            return f"{name} is rank {marker.rank}'s part of {marker.tag!r}"
        recorded = {item.file: (item.size_bytes, item.checksum_algo, item.checksum)
                    for item in marker.items}  # fmt: skip
        announced = {c.name: (c.size, c.algo, c.checksum) for c in self.files
                     if c.name not in (name, MANIFEST_NAME)}  # fmt: skip
        if recorded != announced:
            return f"the items announced are not what its marker ({name}) records"
        if manifest is not None:
            if manifest.tag != self.tag:
                return f"its manifest is of {manifest.tag!r}"
            if any(manifest.item(item.name) != item for item in marker.items):
                return "an item of the part is not what the manifest records"
        return None

    def _commit(self) -> None:
        marker = self._marker
        assert marker is not None  # checked first
        record = {
            "schema_version": DONE_SCHEMA_VERSION,
            "tag": self.tag,
            "rank": self.rank,
            "node": self.node,
            "created_at": marker.created_at,
            "received_at": utc_now(),
            "files": [claim.to_json() for claim in self.files],
        }
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        self.root.publish((self.tag, REPLICA_DONE), data, create_only=True)
