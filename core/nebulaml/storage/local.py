"""The local backend: a root on a local (or mounted) filesystem, through the OS directly.

`LocalBackend` implements the `Backend` primitives (backend.py) with what a local disk
gives: durable writes (fsync of files and of the folders that name them, when `durable`),
a create-only publish by hard link, appends with O_APPEND, direct (O_DIRECT) writes of
page-aligned memory (`write_view`), and mapped reads (`map_read`, `read_local`: see
mapped_reads.py). The memory tier is a local root that is not durable (RAM: nothing to
fsync) and `private` (folders 0700, files 0600).

No file or folder under the root is ever read, written or deleted through a symbolic link
(`_local`), and only regular files are read (mapped_reads.open_regular).

`open_local` is its factory, registered for plain paths, `file://` and `local://`
(builtins.py): it declares every capability but the server's (`Capabilities`).

Not for: fsspec or Azure stores (remote.py, azure.py), or errors as callers see them
(store.py translates). May import: `nebulaml.errors`, `nebulaml.format` and storage/'s
redaction.py, local_files.py, view_writes.py, mapped_reads.py, backend.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from typing import BinaryIO

from nebulaml.errors import StorageError
from nebulaml.storage.backend import Capabilities, OpenRequest, Parts, Written
from nebulaml.storage.local_files import (
    PRIVATE_FILE_MODE,
    PUBLIC_FILE_MODE,
    DirectFile,
    LocalWriter,
    create_file,
    fsync_dir,
    make_folders,
    write_and_close,
)
from nebulaml.storage.mapped_reads import (
    Lender,
    LocalRead,
    map_view,
    open_regular,
    open_regular_fd,
    read_all,
    read_in,
)
from nebulaml.storage.redaction import redact
from nebulaml.storage.view_writes import write_view_chunks


def file_stamp(info: os.stat_result) -> str:
    """What names one version of a local file: its device, inode, size and modification
    time. A write into the file changes it; a link to it or a name of it removed does not
    (they change the inode's ctime, not its mtime), so a file shared by several
    checkpoints keeps its stamp while older ones are deleted.

    Example:
        >>> import os, tempfile
        >>> path = tempfile.mkstemp()[1]
        >>> before = file_stamp(os.stat(path))
        >>> os.link(path, path + ".2"); os.unlink(path + ".2")
        >>> file_stamp(os.stat(path)) == before
        True
        >>> os.unlink(path)
    """
    return f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"


def _whole(ranges: list[tuple[int, int, bool]], size: int) -> bool:
    """Whether `ranges` reuse every byte of a file of `size` bytes (and it has some).

    Example:
        >>> _whole([(0, 4, True), (4, 6, True)], 10), _whole([(0, 4, True), (4, 6, False)], 10)
        (True, False)
    """
    return (
        size > 0
        and all(reuse for _, _, reuse in ranges)
        and sum(length for _, length, _ in ranges) == size
    )


# A local disk: hard links publish create-only, O_APPEND appends, copy_file_range clones.
LOCAL_CAPABILITIES = Capabilities(
    atomic_create=True, object_appends=False, range_copy=False, clones=True, local_path=True
)

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# `write_ranges` writes a changed range in chunks of this size, `sent` called after each
# (where a persist may pause while a save runs: reuse.ReuseBook.pause).
_RANGE_CHUNK_BYTES = 8 << 20


class LocalBackend:
    """A local root at the absolute path `root`. `durable`: fsync what is written (not
    for RAM); `private`: this user's alone (folders 0700, files 0600). `secrets` are
    masked in the messages this backend writes itself."""

    writer_retries = False
    aborted_write_may_leave_file = False  # LocalWriter.abort removes the file
    capabilities = LOCAL_CAPABILITIES

    def __init__(
        self, root: str, *, durable: bool, private: bool, secrets: tuple[str, ...] = ()
    ) -> None:
        self.root = root
        self.url = root
        self.location = os.path.realpath(root)  # one root, whatever link reached it
        self.durable = durable
        self.private = private
        self.file_mode = PRIVATE_FILE_MODE if private else PUBLIC_FILE_MODE
        self._secrets = secrets

    def path(self, parts: Parts) -> str:
        return "/".join([self.root, *parts]) if parts else self.root

    def _local(self, parts: Parts, *, leaf_may_link: bool = False) -> str:
        """The OS path of `parts`, after checking that no folder on the way under the root
        (nor `parts` itself, unless `leaf_may_link`: the caller opens it with O_NOFOLLOW
        or removes the name alone) is a symbolic link: nebula never reads, writes or
        deletes through one (`ln -s ~/project ROOT/global_step9` must not make a save
        delete the files of ~/project). Raises `StorageError` naming the link."""
        path = self.root
        last = len(parts) - (1 if leaf_may_link else 0)
        for i, part in enumerate(parts[:last]):
            path = f"{path}/{part}"
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break  # nothing further down exists
            except OSError:
                break  # reported by the operation itself
            if stat.S_ISLNK(mode):
                raise self._link_error(parts[: i + 1])
        return self.path(parts)

    def _link_error(self, parts: Parts) -> StorageError:
        """The refusal of `parts`, a symbolic link on the way to what was asked."""
        return StorageError(
            redact(
                f"{self.path(parts)}: is a symbolic link; nebula never reads, writes or "
                f"deletes through one (remove the link)",
                self._secrets,
            )
        )

    def _open(self, parts: Parts) -> BinaryIO:
        """The regular file `parts`, open for reading (see `open_regular`)."""
        return open_regular(self._local(parts, leaf_may_link=True), self.path(parts))

    # reading -----------------------------------------------------------------------
    def exists(self, parts: Parts) -> bool:
        # The name itself, link or not; never through a linked folder.
        return os.path.lexists(self._local(parts, leaf_may_link=True))

    def list_folders(self, parts: Parts) -> list[str]:
        try:
            with os.scandir(self._local(parts)) as it:
                return [
                    e.name
                    for e in it
                    if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
                ]
        except FileNotFoundError:
            return []

    def list_files(self, parts: Parts) -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            with os.scandir(self._local(parts)) as it:
                for entry in it:
                    if entry.is_file(follow_symlinks=False):
                        try:
                            out[entry.name] = entry.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            # Removed since the scan saw it (a reader's lease, say): that
                            # file is gone, not the folder.
                            continue
        except (FileNotFoundError, NotADirectoryError):
            return {}  # no such folder (a file of that name is not a tag folder)
        return out

    def list_prefixed(self, parts: Parts, prefix: str) -> dict[str, int]:
        """The regular files of folder `parts` whose names begin with `prefix`, with their
        sizes (`PrefixListingBackend`): the folder's names are filtered first, and only
        those that match are looked at, an lstat each (a link, a FIFO or a folder of such
        a name is left out, as `list_files` leaves it out; nothing is followed)."""
        try:
            fd = os.open(self._local(parts), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out: dict[str, int] = {}
        try:
            for name in os.listdir(fd):
                if not name.startswith(prefix):
                    continue
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the listing
                if stat.S_ISREG(st.st_mode):
                    out[name] = st.st_size
        finally:
            os.close(fd)
        return out

    def list_file_names(self, parts: Parts) -> list[str]:
        """The names of the regular files in folder `parts`, without their sizes: no
        stat per file (the file type comes with the folder's listing)."""
        try:
            with os.scandir(self._local(parts)) as it:
                return [e.name for e in it if e.is_file(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def folder_identity(self, parts: Parts) -> tuple[int, int] | None:
        try:
            st = os.stat(self._local(parts), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        return (st.st_ino, st.st_mtime_ns)

    def list_non_files(self, parts: Parts) -> list[str]:
        try:
            with os.scandir(self._local(parts)) as it:
                return [e.name for e in it if not e.is_file(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _regular_stat(self, parts: Parts) -> os.stat_result | None:
        """`lstat` of `parts`, a regular file; None where it is missing or something else
        (a link is not followed)."""
        try:
            st = os.lstat(self._local(parts, leaf_may_link=True))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    def file_identity(self, parts: Parts) -> tuple[int, int, int] | None:
        st = self._regular_stat(parts)
        return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns)

    def file_stamp(self, parts: Parts) -> str | None:
        """The regular file `parts` as it is now (`file_stamp`), or None where it is not
        one (gone, a link, a FIFO)."""
        st = self._regular_stat(parts)
        return None if st is None else file_stamp(st)

    def modified_at(self, parts: Parts) -> datetime | None:
        try:
            mtime = os.stat(self._local(parts, leaf_may_link=True), follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return None
        return datetime.fromtimestamp(mtime, timezone.utc)

    def read_bytes(self, parts: Parts) -> bytes:
        fd = open_regular_fd(self._local(parts, leaf_may_link=True), self.path(parts))
        try:
            return read_all(fd)
        finally:
            os.close(fd)

    def open_read(self, parts: Parts) -> BinaryIO:
        return self._open(parts)

    def read_appended(self, parts: Parts) -> bytes | None:
        # One file: `append` adds to it in place.
        try:
            return self.read_bytes(parts)
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def _opened(self, parts: Parts) -> Iterator[tuple[BinaryIO, os.stat_result] | None]:
        """The regular file `parts` and its `fstat`, closed at the end; None for an empty
        file (the callers then read bytes)."""
        f = self._open(parts)
        try:
            st = os.fstat(f.fileno())
            yield (f, st) if st.st_size else None
        finally:
            f.close()

    @contextlib.contextmanager
    def map_read(self, parts: Parts, lend: Lender | None) -> Iterator[memoryview | None]:
        """A file's bytes mapped read-only (or lent by `lend`, see `Store.map_read`);
        None for an empty file."""
        with self._opened(parts) as opened:
            if opened is None:
                yield None
                return
            f, st = opened
            with map_view(f, st, lend) as view:
                yield view

    @contextlib.contextmanager
    def read_local(self, parts: Parts, *, algo: str | None) -> Iterator[LocalRead | None]:
        """A file's bytes in memory that loaded tensors may keep (see `Store.read_local`);
        None for an empty file, or without /proc."""
        if not os.path.isdir("/proc/self/fd"):
            yield None
            return
        with self._opened(parts) as opened:
            if opened is None:
                yield None
                return
            f, st = opened
            path = self.path(parts)
            with read_in(f, st.st_size, path, durable=self.durable, algo=algo) as read:
                yield read

    # writing -----------------------------------------------------------------------
    def make_dir(self, parts: Parts) -> None:
        """Create the root and the folders `parts` under it, as real folders (0700 in a
        private store, the folders above a missing root too), each new entry made
        durable; never through a symbolic link."""
        path = self._local(parts)
        if os.path.isdir(path) and not os.path.islink(path):
            return
        mode = 0o700 if self.private else 0o777
        if not os.path.isdir(self.root):
            make_folders(os.path.dirname(self.root), self.private)
            try:
                os.mkdir(self.root, mode)
                if self.durable:
                    fsync_dir(os.path.dirname(self.root))
            except FileExistsError:
                if not os.path.isdir(self.root):
                    raise
        folder = self.root
        for part in parts:
            parent, folder = folder, f"{folder}/{part}"
            try:
                os.mkdir(folder, mode)
            except FileExistsError:
                self._local(parts)  # a link made meanwhile is refused, not followed
                if not os.path.isdir(folder):
                    raise
                continue
            if self.durable:
                fsync_dir(parent)

    def make_new_dir(self, parts: Parts) -> bool:
        """`make_dir`, and whether the folder `parts` is new: made by this call (False:
        something was there, the folder made earlier or another hand's entry). A save's
        next tag: one mkdir where its parent is there, no look first."""
        path = self._local(parts)
        mode = 0o700 if self.private else 0o777
        try:
            os.mkdir(path, mode)
        except FileNotFoundError:  # the root or a folder on the way is missing
            self.make_dir(parts[:-1])
            try:
                os.mkdir(path, mode)
            except FileExistsError:
                return False
        except FileExistsError:
            return False
        if self.durable:
            fsync_dir(os.path.dirname(path))
        return True

    def link(self, source: Parts, parts: Parts) -> bool:
        """Give the regular file `source` the name `parts` as well (a hard link: whole or
        not at all), unless the name exists; False where it could not (no such file, a
        name there, a filesystem without hard links): the caller writes the file instead.
        Neither name is reached through a symbolic link, nor is a link linked."""
        try:
            src = self._local(source)
            dst = self._local(parts, leaf_may_link=True)
            os.link(src, dst, follow_symlinks=False)
        except (OSError, StorageError):
            return False
        if self.durable:
            fsync_dir(os.path.dirname(dst))
        return True

    def open_write(self, parts: Parts, *, durable: bool = True) -> LocalWriter:
        """A buffered writer; its close() fsyncs (when durable, and the root is), its
        abort() removes."""
        return LocalWriter(
            self._local(parts, leaf_may_link=True), self.durable and durable, self.file_mode
        )

    def write_view(
        self,
        parts: Parts,
        view: memoryview,
        each: Callable[[memoryview], None],
        sent: Callable[[int], None] | None = None,
    ) -> None:
        """Write page-aligned `view` as a new file with O_DIRECT where the filesystem
        allows it (local_files.DirectFile), calling `each(piece)` on every piece in order and
        `sent(len(piece))` once it is written; removed if this raises."""
        out = DirectFile(
            self._local(parts, leaf_may_link=True), durable=self.durable, mode=self.file_mode
        )

        def write_at(piece: memoryview, offset: int) -> None:
            out.write_at(piece, offset)
            if sent is not None:
                sent(len(piece))

        try:
            write_view_chunks(write_at, view, each)
            out.close()
        except BaseException:
            out.abort()
            raise

    def write_ranges(
        self,
        parts: Parts,
        view: memoryview,
        ranges: Iterable[tuple[int, int, bool]],
        base: Parts | None,
        sent: Callable[[int], None] | None = None,
        base_stamp: str | None = None,
    ) -> Written:
        """Write `view` as a new file, durable on return (removed if this raises), range by
        range: (offset, length, reuse) where `reuse` means the file `base` holds the same
        bytes at the same offsets, cloned from it inside the filesystem
        (`DirectFile.clone_from`) instead of written; a range the filesystem cannot clone
        (or every one, when `base` cannot be opened) is written from `view`. Returns
        (bytes written, bytes cloned); `sent(n)` after each range cloned and each chunk of
        at most 8 MiB written. `base` is opened as any read is: a regular file,
        never through a symbolic link.

        Where every range is reused and `base` is the whole file, `parts` becomes a hard
        link to it (`_link_whole`): no data is written, on ext4 either, where a clone
        is a copy inside the kernel that reaches the disk all the same.

        With `base_stamp` (what a write returned for `base`, or `file_stamp`), nothing is
        taken from `base` unless it is still that file, unwritten since (its device,
        inode, size and modification time): a tool that wrote into it, or another file
        in its place, gets the new file written whole. A link is made only then. The
        result's stamp is the new file's."""
        ranges = list(ranges)
        if (
            base is not None
            and base_stamp is not None
            and _whole(ranges, len(view))
            and self._link_whole(base, parts, len(view), base_stamp)
        ):
            if sent is not None:
                sent(len(view))
            return Written(0, len(view), base_stamp)
        out = DirectFile(
            self._local(parts, leaf_may_link=True), durable=self.durable, mode=self.file_mode
        )
        source: BinaryIO | None = None
        written = cloned = 0
        try:
            if base is not None:
                with contextlib.suppress(OSError, StorageError):
                    source = self._open(base)
            if (
                source is not None
                and base_stamp is not None
                and file_stamp(os.fstat(source.fileno())) != base_stamp
            ):
                source.close()
                source = None  # written (or replaced) since: nothing taken from it
            for offset, length, reuse in ranges:
                taken = 0
                if reuse and source is not None:
                    taken = out.clone_from(source.fileno(), offset, length)
                    cloned += taken
                    if taken < length:
                        source.close()
                        source = None  # this filesystem cannot: write the rest
                if sent is not None and taken:
                    sent(taken)
                end = offset + length
                for at in range(offset + taken, end, _RANGE_CHUNK_BYTES):
                    upto = min(at + _RANGE_CHUNK_BYTES, end)
                    out.write_at(view[at:upto], at)
                    written += upto - at
                    if sent is not None:
                        sent(upto - at)
            made = out.stat()  # the file written, as it is once whole
            out.close()
        except BaseException:
            out.abort()
            raise
        finally:
            if source is not None:
                source.close()
        return Written(written, cloned, file_stamp(made))

    def _link_whole(self, base: Parts, parts: Parts, size: int, stamp: str) -> bool:
        """Name the regular file `base` `parts` too (a hard link), if it is this user's
        file of `size` bytes, its mode within the root's, still the file of `stamp`
        (`file_stamp`), and `parts` is free; False
        (nothing made) where not: the caller writes the file. The link is checked
        against the file opened first (its device and inode), so that a name swapped
        meanwhile for a symbolic link or another file is never linked in; what was linked
        by mistake is removed. Never in a root that is not durable (the memory tier): its
        slot pool recycles files and writes them in place, which a file shared by two
        checkpoints must never be."""
        if not self.durable:
            return False
        try:
            source = self._open(base)
        except (OSError, StorageError):
            return False
        with source:
            info = os.fstat(source.fileno())
            if (
                info.st_size != size
                or file_stamp(info) != stamp
                or info.st_uid != os.geteuid()
                or stat.S_IMODE(info.st_mode) & ~self.file_mode  # a mode more open than the root's
            ):
                return False
            try:
                dst = self._local(parts, leaf_may_link=True)
                os.link(self._local(base, leaf_may_link=True), dst, follow_symlinks=False)
            except (OSError, StorageError):
                return False
            made = os.lstat(dst)
            if (made.st_dev, made.st_ino) != (info.st_dev, info.st_ino):
                with contextlib.suppress(OSError):
                    os.unlink(dst)
                return False
        if self.durable:
            fsync_dir(os.path.dirname(dst))
        return True

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        """Write a temporary file, fsync, hard-link it into place (which fails if the name
        exists) or rename it over, then fsync the folder."""
        path = self._local(parts, leaf_may_link=True)
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        fd = create_file(tmp, self.file_mode, exclusive=True)
        renamed = False  # the temporary name is gone
        try:
            write_and_close(fd, data, durable=self.durable)
            if create_only:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                        raise
                    # A filesystem without hard links: check, then rename.
                    if os.path.exists(path):
                        raise FileExistsError(errno.EEXIST, "exists", path) from exc
                    os.replace(tmp, path)
                    renamed = True
            else:
                os.replace(tmp, path)
                renamed = True
            if self.durable:
                fsync_dir(folder)
        finally:
            if not renamed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def append(self, parts: Parts, data: bytes, *, append_id: str) -> None:
        """One O_APPEND write (whole lines from concurrent writers stay whole), fsynced."""
        del append_id  # one file takes every append in place
        # A FIFO planted in the file's place must not block the persister for ever, nor a
        # link lead the append elsewhere (open_regular_fd).
        fd = open_regular_fd(
            self._local(parts, leaf_may_link=True),
            self.path(parts),
            flags=os.O_WRONLY | os.O_CREAT | os.O_APPEND,
            mode=self.file_mode if self.private else 0o644,
            refusal="nebula appends only to its own",
            link="not a regular file",
        )
        try:
            # One write per batch keeps concurrent appenders' lines whole.
            os.write(fd, data)
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def rotate_appended(self, parts: Parts, max_bytes: int, head: bytes) -> bool:
        """Once the regular file `parts` holds `max_bytes`, it becomes `<name>.1` (linked
        there, replacing the one before) and a new file holding `head` is renamed over its
        name: the name is never missing, so an `append` meanwhile lands whole in one or
        the other. Rotators take turns (an exclusive flock on the file), and each rotates
        only the file it found full. Never a symbolic link, a FIFO or a folder: those
        stay as they are. Whether it rotated."""
        name = parts[-1]
        rotated, staged, linked = f"{name}.1", f".{name}.{uuid.uuid4().hex}", None
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with self._parent(parts) as folder:
            try:
                fd = os.open(name, flags, dir_fd=folder)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    return False  # nothing there, or not a file nebula appends to
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size < max_bytes:
                    return False
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes
                now = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    return False  # another process rotated it first
                mode = self.file_mode if self.private else 0o644
                out = os.open(staged, _NEW_FILE, mode, dir_fd=folder)
                write_and_close(out, head, durable=self.durable)
                linked = f"{staged}.1"
                os.link(name, linked, src_dir_fd=folder, dst_dir_fd=folder,
                        follow_symlinks=False)  # fmt: skip
                os.replace(linked, rotated, src_dir_fd=folder, dst_dir_fd=folder)
                os.replace(staged, name, src_dir_fd=folder, dst_dir_fd=folder)
                if self.durable:
                    os.fsync(folder)
                return True
            finally:
                os.close(fd)
                for leftover in (staged, linked):
                    if leftover is not None:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(leftover, dir_fd=folder)

    def remove(self, parts: Parts, *, sync: bool = True) -> None:
        try:
            with self._parent(parts) as folder:
                os.unlink(parts[-1], dir_fd=folder)  # a link: the name alone
                if sync and self.durable and parts[:-1]:
                    os.fsync(folder)
        except FileNotFoundError:
            return

    def clear_squatter(self, parts: Parts) -> bool:
        """Remove what sits at `parts` if it is not a regular file: a FIFO, a symbolic
        link (the name, never what it points to) or an empty folder. Whether it removed
        one; False for a regular file, a folder with files in it, or nothing there."""
        try:
            with self._parent(parts) as folder:
                mode = os.lstat(parts[-1], dir_fd=folder).st_mode
                if stat.S_ISREG(mode):
                    return False
                if stat.S_ISDIR(mode):
                    try:
                        os.rmdir(parts[-1], dir_fd=folder)  # a link is not a folder
                    except OSError as exc:
                        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                            return False
                        raise
                else:
                    os.unlink(parts[-1], dir_fd=folder)
                if self.durable:
                    os.fsync(folder)
                return True
        except FileNotFoundError:
            return False

    def sync_dir(self, parts: Parts) -> None:
        """fsync the folder `parts` (when durable), opened one folder at a time from the
        root as `_parent` opens them: never through a symbolic link."""
        if not self.durable:
            return
        with contextlib.suppress(FileNotFoundError), self._parent((*parts, "")) as folder:
            os.fsync(folder)

    def remove_dir(self, parts: Parts) -> None:
        if not parts:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(self.root)
            return
        with contextlib.suppress(FileNotFoundError), self._parent(parts) as folder:
            os.rmdir(parts[-1], dir_fd=folder)  # a link is not a folder: ENOTDIR

    @contextlib.contextmanager
    def _parent(self, parts: Parts) -> Iterator[int]:
        """The folder that holds `parts`, open (a file descriptor), reached one folder at
        a time from the root with O_NOFOLLOW: a delete then names its file in that very
        folder, so that no folder swapped for a symbolic link between a check and the
        delete can send it elsewhere (`_local`'s check and the unlink were two steps).
        Raises `StorageError` naming a link on the way; FileNotFoundError when a folder
        is missing."""
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.root, flags)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    child = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    if not stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                        raise FileNotFoundError(exc.errno, exc.strerror) from exc
                    raise self._link_error(parts[: i + 1]) from exc
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)


def open_local(request: OpenRequest) -> LocalBackend:
    """The backend of a local root: a plain path, `file://...` or `local://...` (storage
    options do not apply to local roots).

    Example:
        >>> import tempfile
        >>> backend = open_local(OpenRequest("file://" + tempfile.gettempdir(), "file", {}))
        >>> backend.capabilities.local_path, backend.root == tempfile.gettempdir()
        (True, True)
    """
    from fsspec.implementations.local import LocalFileSystem

    path = LocalFileSystem._strip_protocol(request.url)
    return LocalBackend(os.path.abspath(path), durable=request.durable, private=request.private,
                        secrets=tuple(request.secrets))  # fmt: skip
