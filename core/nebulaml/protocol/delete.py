"""Deleting a checkpoint from one tier: the manifest first, then the data.

    delete_checkpoint   a whole tag: invisible at once, then gone; never a tag being read
    delete_checkpoints  several whole tags (prune): their manifests' removals made durable
                        together, then their data
    delete_part         one rank's part of a shared tag folder (several ranks, one node)

A deleter first writes a writer marker naming itself (its claim), so that a delete cut
short leaves a leftover recovery knows to be a dead writer's (recovery.py), and publishes
a delete claim, so that no reader's tag goes under it (leases.py). What another hand
planted at a lease's or a marker's name that is no regular file (a FIFO, a link) is
junk: no reader, no part; it goes with the folder, removed by name.

A tag's entries in the tier's commit index go once its folder is gone (commit_index.py).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, commit_index.py,
leases.py and markers.py. Not for: deciding what to delete (retention.py,
ops/pruning.py) or replacing a tag (commit.py's `begin_tag` deletes through here).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable

from nebulaml.errors import NebulaError, StorageError
from nebulaml.format.manifest import parse_marker
from nebulaml.format.names import MANIFEST_NAME, marker_name, validate_name, writer_marker_name
from nebulaml.protocol.commit_index import forget_tags
from nebulaml.protocol.leases import delete_claim, is_lease_file
from nebulaml.protocol.markers import is_marker, read_writers, writer_alive, writer_record
from nebulaml.storage.store import MissingFileError, Store


def delete_checkpoint(
    store: Store,
    tag: str,
    *,
    discard: Callable[[str, str], object] | None = None,
    replacing: bool = False,
    own_holds: bool = True,
) -> bool:
    """Delete a tag: the manifest first (so it is invisible at once), then the data.

    A checkpoint being read is never deleted: this publishes a delete claim, then looks
    for live read leases (leases.py); if there is one it returns False and the tag stays
    as it is (the caller reports it, or tries again later). Returns True once the tag is
    gone (also when there was nothing to delete).

    A writer marker naming this process goes in before the manifest goes out, so that a
    delete cut short (the process killed) leaves a leftover that recovery knows to be a
    dead writer's, not files nobody claims. `discard(tag, name)`, when given, disposes of
    each data file instead of removing it (the memory tier recycles them: slots.py).
    `replacing`: the tag is about to be written again by its writer (`overwrite=True`),
    which waits for readers but not for handles' holds; `own_holds=False`: this process's
    holds do not keep the tag, only its reads (leases.py's `delete_claim`).
    """
    validate_name("tag", tag)
    gone = _delete_checkpoint(store, tag, discard, replacing, own_holds)
    if gone:
        forget_tags(store, [tag])
    return gone


def _delete_checkpoint(
    store: Store,
    tag: str,
    discard: Callable[[str, str], object] | None,
    replacing: bool,
    own_holds: bool,
) -> bool:
    files = store.list_files(tag)
    if not files:
        _remove_folder(store, tag)  # an empty folder (a store with real folders)
        return True
    if MANIFEST_NAME not in files:
        # Uncommitted: nobody can be reading it (leases.py), and a full disk must not keep
        # a failed write's leftovers from going for want of room for a claim. But a live
        # writer may have started it since the caller judged it a leftover: its marker
        # would be overwritten by our claim, and its files deleted under it.
        if _live_writer(store, tag):
            return False
        try:
            _claim(store, tag, 0)
        except MissingFileError:
            return True  # another deleter was quicker
        if store.exists(tag, MANIFEST_NAME):
            # Its writer committed it after the listing (and then removed its marker): not
            # a leftover, and a reader may hold it already; a deleter of committed tags
            # (retention, prune) judges it again.
            store.remove(tag, writer_marker_name(0))
            return False
        _remove_checkpoint(store, tag, files, discard)
        return True
    with contextlib.ExitStack() as claims:
        taken = _take_down(store, tag, claims, replacing=replacing, own_holds=own_holds)
        if taken is not None:
            return taken
        _remove_data(store, tag, files, discard)
    return True


def delete_checkpoints(store: Store, tags: Iterable[str]) -> dict[str, bool | StorageError]:
    """Delete several committed tags, as `delete_checkpoint` deletes each, but with the
    manifests' removals made durable together: every manifest first (each under its
    delete claim, never one being read), then each folder fsynced, then the data. On a
    journalling filesystem (ext4, XFS) the first fsync commits every removal before it,
    and the others find theirs committed: one journal commit for the lot, where one
    tag at a time waits for one each (prune spent half its time there).

    Returns, per tag, True once gone (or nothing was there), False while a reader holds
    it (left as it is), or the `StorageError` that stopped its delete (its manifest may be
    gone and its data left: a leftover, as a delete cut short leaves). A tag that is not
    committed (a leftover, an empty folder) is deleted on its own, by `delete_checkpoint`.

    Example:
        >>> import tempfile
        >>> delete_checkpoints(Store(tempfile.mkdtemp()), ["global_step1"])
        {'global_step1': True}
    """
    out: dict[str, bool | StorageError] = {}
    unsynced: list[tuple[str, dict[str, int]]] = []
    with contextlib.ExitStack() as claims:
        for tag in tags:
            validate_name("tag", tag)
            try:
                files = store.list_files(tag)
                if MANIFEST_NAME not in files:
                    out[tag] = delete_checkpoint(store, tag)
                    continue
                taken = _take_down(store, tag, claims, durable=False)  # durable below
                if taken is not None:
                    out[tag] = taken
                    continue
                unsynced.append((tag, files))
            except StorageError as exc:
                out[tag] = exc
        synced = []
        for tag, files in unsynced:
            try:
                store.sync_folder(tag)  # before any of its data goes
                synced.append((tag, files))
            except StorageError as exc:
                out[tag] = exc
        for tag, files in synced:
            try:
                _remove_data(store, tag, files, None)
                out[tag] = True
            except StorageError as exc:
                out[tag] = exc
    forget_tags(store, [tag for tag, gone in out.items() if gone is True])
    return out


def delete_part(
    store: Store,
    tag: str,
    rank: int,
    *,
    keep_folder: bool = False,
    discard: Callable[[str, str], object] | None = None,
    replacing: bool = False,
    own_holds: bool = True,
) -> bool:
    """Remove one rank's part of a shared tag folder: the manifest first (the tag is then
    invisible on this tier), then the items this rank's marker lists, then its markers,
    then the folder if no other rank's files remain. A writer marker naming this process
    is there from the start, so a delete cut short is a dead writer's leftover.

    Returns False, and changes nothing, while a live reader holds a lease on the
    committed tag (leases.py); True once the part is gone. `discard(tag, name)`, when
    given, disposes of each item file instead (the memory tier recycles them: slots.py).
    `replacing` and `own_holds` are `delete_checkpoint`'s.
    """
    files = store.list_files(tag)
    if not files:
        return True
    if MANIFEST_NAME not in files and marker_name(rank) not in files:
        # Uncommitted: nobody can be reading it (leases.py), and a full disk must not keep
        # a failed write's leftovers from going for want of room for a claim.
        _remove_part(store, tag, rank, files, keep_folder, discard)
        return True
    # Committed: the tag (its manifest), or this rank's part of it on a tier that holds
    # no manifest (a node's memory tier in a job over several nodes), which a replica's
    # sender holds while it reads it (leases.hold_tag by the marker).
    committed = MANIFEST_NAME if MANIFEST_NAME in files else marker_name(rank)
    with contextlib.ExitStack() as stack:
        try:
            readers = stack.enter_context(
                delete_claim(
                    store, tag, replacing=replacing, own_holds=own_holds, committed=committed
                )
            )
        except StorageError:
            if committed == MANIFEST_NAME:
                raise
            # No room for a claim (a full RAM disk, which this delete is to make room on):
            # removed unclaimed, as before parts were held; a sender reading it then
            # finds its part changed, and the partner refuses what it sent.
            readers = []
        if readers:
            return False
        _remove_part(store, tag, rank, files, keep_folder, discard)
    return True


def _remove_part(
    store: Store,
    tag: str,
    rank: int,
    files: dict[str, int],
    keep_folder: bool,
    discard: Callable[[str, str], object] | None = None,
) -> None:
    try:
        _claim(store, tag, rank)
    except MissingFileError:
        return  # the folder went meanwhile: another deleter was quicker
    store.remove(tag, MANIFEST_NAME)
    own: set[str] = set()
    if marker_name(rank) in files:
        try:
            marker = parse_marker(
                store.read_bytes(tag, marker_name(rank)), store.display(tag, marker_name(rank))
            )
            own = {item.file for item in marker.items}
        except (NebulaError, ValueError):
            own = set()
    for name in sorted(own & set(files)):
        if discard is not None:
            discard(tag, name)
        store.remove(tag, name, durable=False)
    store.remove(tag, marker_name(rank), durable=False)
    store.remove(tag, writer_marker_name(rank), durable=False)
    # Leases (our claim among them) are no other rank's files.
    if not keep_folder and not [n for n in store.list_files(tag) if not is_lease_file(n)]:
        _remove_folder(store, tag, files)
        forget_tags(store, [tag])


def _take_down(
    store: Store,
    tag: str,
    claims: contextlib.ExitStack,
    *,
    replacing: bool = False,
    own_holds: bool = True,
    durable: bool = True,
) -> bool | None:
    """Make the committed `tag` invisible: publish this thread's delete claim, and unless
    a reader holds the tag, write our writer marker (no moment without a claim) and
    remove the manifest (fsynced unless `durable=False`: the caller then syncs the folder
    before any data goes). None once the manifest is gone, the claim left in `claims`
    until the data is; else the delete's outcome, the claim gone at once: False while a
    reader holds the tag, True when another deleter (prune, retention, eviction) was
    quicker."""
    with contextlib.ExitStack() as claim:
        if claim.enter_context(delete_claim(store, tag, replacing=replacing, own_holds=own_holds)):
            return False
        try:
            _claim(store, tag, 0)
        except MissingFileError:
            return True
        store.remove(tag, MANIFEST_NAME, durable=durable)
        claims.enter_context(claim.pop_all())
    return None


def _claim(store: Store, tag: str, rank: int) -> None:
    """Write this process's writer marker into `tag` (before it changes what is there)."""
    # Written in place, not published: on a full disk a delete must still get its claim
    # in (a deleter's half-written claim only makes another deleter delete too). Not
    # fsynced: it tells live processes that a delete is under way; after a crash there
    # are none, and the manifest's removal (fsynced before any data goes) is what keeps
    # a half-deleted tag from reading as committed.
    store.write_bytes(
        (tag, writer_marker_name(rank)), writer_record(rank, deleting=True), durable=False
    )


def _live_saver(store: Store, tag: str, files: dict[str, int] | None = None) -> bool:
    """Whether another live process on this host is saving into `tag` (a writer marker
    that is not a deleter's claim); `files`: the folder as just listed."""
    me = os.getpid()
    return any(
        w.get("pid") != me and not w.get("deleting") and writer_alive(w)
        for w in read_writers(store, tag, files)
    )


def _live_writer(store: Store, tag: str) -> bool:
    """Whether another live process on this host is writing `tag` (its writer marker)."""
    me = os.getpid()
    return any(w.get("pid") != me and writer_alive(w) for w in read_writers(store, tag))


def _remove_checkpoint(
    store: Store, tag: str, files: dict[str, int], discard: Callable[[str, str], object] | None
) -> None:
    store.remove(tag, MANIFEST_NAME)  # durable before any data goes
    _remove_data(store, tag, files, discard)


def _remove_data(
    store: Store, tag: str, files: dict[str, int], discard: Callable[[str, str], object] | None
) -> None:
    """After the manifest's durable removal: the data, the markers, the folder."""
    # Data first, our markers last: whatever a kill leaves behind still carries them. Not
    # fsynced one by one: what a crash brings back is a leftover with our claim in it.
    for name in files:
        if not name.startswith(".") and name != MANIFEST_NAME:
            if discard is not None:
                discard(tag, name)
            store.remove(tag, name, durable=False)
    _remove_folder(store, tag, files)


def _remove_folder(store: Store, tag: str, known: Iterable[str] = (), tries: int = 8) -> None:
    """Remove the folder of a deleted tag with what is left in it (markers, leases).

    A reader may create its lease between the listing and the removal of the folder (it
    then finds no manifest and leaves), or another deleter its claim (it then finds the
    folder gone, or empties it too): the folder is not empty, so try again, a little later,
    once what was planted at our names is cleared (`_clear_planted`).
    Files that were not there when the delete listed the folder (`known`), other than
    leases and claims, are a new writer's (the tag saved again): the folder is theirs then.
    So is it while another live process's writer marker (not a deleter's claim) is there:
    a rank saving the tag again writes its marker and items under the names of its old
    ones, which the listing knew.
    """
    delay_s = 0.001
    known = set(known) | {writer_marker_name(0)}
    for attempt in range(tries):
        present = store.list_files(tag)
        if any(name not in known and not is_lease_file(name) for name in present):
            return
        if _live_saver(store, tag, present):
            return
        try:
            store.remove_dir(tag, files=present)
            return
        except StorageError:
            if attempt == tries - 1:
                raise
        _clear_planted(store, tag)
        time.sleep(delay_s)
        delay_s *= 2


def _clear_planted(store: Store, tag: str) -> None:
    """Remove what is no regular file at a lease's or a marker's name in the folder of a
    deleted tag (a FIFO, a socket, a link, a folder): nebula writes only regular files
    there, and `list_files` does not show these, so the folder would never empty. By name,
    never through a link (`Store.clear_squatter`); other names are left to their owner."""
    for name in store.list_non_files(tag):
        if is_lease_file(name) or is_marker(name):
            store.clear_squatter(tag, name)
