"""Exporting a committed checkpoint's items as plain files: `nebula export` and
`nebula latest --local`.

    export_checkpoint  one file per item in a local folder, verified against the manifest:
                       torch's own format (`<item>.pt`: the item's bytes as committed,
                       which `torch.load(path, weights_only=True)` reads) or safetensors
                       (`<item>.safetensors`: the item's tensors by their dotted path)
    flatten_tensors    an item's tensors by dotted path (`layers.0.weight`), and the paths
                       of what is not a tensor

Every file is written beside its final name and renamed into place once complete, so an
interrupted export never leaves a partial file under an item's name; a `.pt` file already
there with the item's size and checksum is kept (a rerun copies nothing twice). Files get
the mode any program's new file gets (the umask: 0644 typically), so that another user's
serving process can read them; 0600 when private (`private=True`, `NEBULA_PRIVATE=1`).

May import: every layer below ops. Not for: copying between roots (copying.py) or loading
items in a training process (runtime/load.py, which this reads through).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nebulaml.config import private_default
from nebulaml.errors import CorruptCheckpointError, InvalidArgumentError, NebulaError
from nebulaml.format.checksum import new_hasher, unknown_algo
from nebulaml.format.jsonbounds import JsonBoundsError, load_json
from nebulaml.format.manifest import ItemEntry, Manifest
from nebulaml.format.names import validate_name
from nebulaml.runtime.load import load_item
from nebulaml.runtime.locate import Copy, check_root, find_copy, tiers_for
from nebulaml.storage.failures import translate_errors
from nebulaml.storage.local_files import create_file, make_folders, new_file_mode

PathLike = str | os.PathLike[str]
Progress = Callable[[int, int], None]

FORMATS = ("pt", "safetensors")
SAFETENSORS_HINT = "safetensors is not installed: pip install 'nebula-checkpoint[safetensors]'"
_CHUNK_BYTES = 8 << 20


def export_checkpoint(
    root: PathLike,
    tag: str,
    dest: PathLike,
    *,
    format: str = "pt",
    items: list[str] | None = None,
    drop_non_tensors: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
    private: bool | None = None,
) -> dict[str, Any]:
    """Write each item of the committed checkpoint `tag` of `root` (or only `items`) as one
    file in the local folder `dest` (created if missing), verified.

    The files' mode is what any program's new file gets there (0666 less the umask:
    0644 typically); with `private` (None: `NEBULA_PRIVATE`) they are 0600, and a `dest`
    created here is 0700, as are the folders above it that were missing.

    `format="pt"`: `<item>.pt`, the item's committed bytes, hashed on the way and checked
    against the manifest's size and checksum (a copy that does not match is passed over
    for the next tier's); `torch.load(path, weights_only=True)` reads it.
    `format="safetensors"`: `<item>.safetensors`, the item loaded with `weights_only`
    reads (verified first) and its tensors saved by dotted path (`layers.0.weight`), with
    `nebula_tag`, `nebula_item`, `nebula_checksum` (the item's) and `nebula_dropped` (a
    JSON list) in the file's metadata.
    safetensors holds tensors only: an item with other values (a learning rate, a step
    count) raises `InvalidArgumentError` naming them before any file is written, unless
    `drop_non_tensors` leaves them out.

    A file already at `dest` that is the item (a `.pt` file with its size and checksum, a
    `.safetensors` one written from it) is kept as it is (`reused`); any other existing
    file raises `NebulaError` unless `overwrite`.
    `progress(bytes_done, bytes_total)` is called as item bytes are read.

    Returns a JSON-serialisable dict: `root`, `tag`, `format`, `destination` and `files`,
    one per item: `item`, `path`, `size_bytes`, `reused`, `tensors` (how many; None for
    `pt`) and `dropped` (the paths left out). Raises `RootNotFoundError`,
    `CheckpointNotFoundError`, `ItemNotFoundError`, `CorruptCheckpointError`.

    Example:
        >>> import nebulaml as nm, tempfile, torch
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root)
        >>> nm.Checkpoint("global_step1").save("model", {"w": torch.ones(2)})
        >>> out = nm.ops.export_checkpoint(root, "global_step1", tempfile.mkdtemp())
        >>> torch.load(out["files"][0]["path"], weights_only=True)["w"]
        tensor([1., 1.])
    """
    validate_name("tag", tag)
    if format not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    for name in items or []:
        validate_name("item", name)
    if format == "safetensors":
        try:
            import safetensors.torch  # noqa: F401 - imported when needed only
        except ImportError:
            raise NebulaError(SAFETENSORS_HINT) from None
    location = check_root(root)
    tiers = tiers_for(root, "export_checkpoint")
    manifest = find_copy(tiers, tag, lambda copy: copy.manifest, root=location)
    entries = _entries(manifest, tag, items)
    if format == "safetensors" and not drop_non_tensors:
        for entry in entries:  # before any file is written: from the pickles alone
            _refuse_non_tensors(root, tag, entry.name)
    folder = Path(dest)
    private = private_default() if private is None else private
    # What the local folder refuses (permissions, a full disk) is one StorageError naming it.
    with translate_errors(str(folder)):
        return _export_entries(tiers, location, tag, entries, folder, format, overwrite,
                               drop_non_tensors, private, progress)  # fmt: skip


def _export_entries(tiers: Any, location: str, tag: str, entries: list[ItemEntry], folder: Path,
                    format: str, overwrite: bool, drop_non_tensors: bool, private: bool,
                    progress: Progress | None) -> dict[str, Any]:  # fmt: skip
    make_folders(str(folder), private)  # private: 0700, the missing folders above it too
    mode = new_file_mode(str(folder), private)
    total = sum(entry.size_bytes for entry in entries)
    done = 0
    if progress is not None:
        progress(0, total)
    files = []
    for entry in entries:
        target = folder / f"{entry.name}.{format}"

        def advance(n: int, base: int = done) -> None:
            if progress is not None:
                progress(min(total, base + n), total)

        if format == "pt":
            record = _export_pt(tiers, tag, entry, target, overwrite, advance, mode)
        else:
            record = _export_safetensors(tiers, tag, entry, target, overwrite, drop_non_tensors,
                                         mode)  # fmt: skip
        done += entry.size_bytes
        advance(0, done)
        files.append(record)
    return {
        "root": location,
        "tag": tag,
        "format": format,
        "destination": str(folder),
        "files": files,
    }


def _entries(manifest: Manifest, tag: str, items: list[str] | None) -> list[ItemEntry]:
    from nebulaml.errors import ItemNotFoundError

    if not items:
        return list(manifest.items)
    out = []
    for name in dict.fromkeys(items):
        entry = manifest.item(name)
        if entry is None:
            raise ItemNotFoundError(tag, name, [item.name for item in manifest.items])
        out.append(entry)
    return out


def _record(entry: ItemEntry, target: Path, *, reused: bool, tensors: int | None = None,
            dropped: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "item": entry.name,
        "path": str(target),
        "size_bytes": target.stat().st_size,
        "reused": reused,
        "tensors": tensors,
        "dropped": dropped or [],
    }


def _matches(path: Path, entry: ItemEntry) -> bool:
    """Whether the file at `path` is the item: its size and checksum."""
    try:
        if path.stat().st_size != entry.size_bytes:
            return False
        hasher = new_hasher(entry.checksum_algo)
    except (OSError, InvalidArgumentError):
        return False
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest() == entry.checksum


def _refuse_existing(target: Path, entry: ItemEntry, tag: str, overwrite: bool) -> None:
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise NebulaError(
            f"{target}: already exists and is not item {entry.name!r} of {tag!r}; "
            "overwrite=True (nebula export --overwrite) replaces it"
        )
    if target.is_dir() and not target.is_symlink():
        raise NebulaError(f"{target}: is a folder")


@contextlib.contextmanager
def _beside(target: Path) -> Iterator[Path]:
    """A temporary path beside `target`, removed unless it was renamed into place."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _export_pt(tiers: Any, tag: str, entry: ItemEntry, target: Path, overwrite: bool,
               advance: Callable[[int], None], mode: int) -> dict[str, Any]:  # fmt: skip
    if _matches(target, entry):
        return _record(entry, target, reused=True)
    _refuse_existing(target, entry, tag, overwrite)

    def write(copy: Copy) -> dict[str, Any]:
        found = copy.entry
        assert found is not None
        where = copy.store.display(tag, found.file)
        expected = f"{found.size_bytes} bytes with {found.checksum_algo} {found.checksum}"
        try:
            hasher = new_hasher(found.checksum_algo)
        except InvalidArgumentError:
            raise CorruptCheckpointError(
                where, expected, unknown_algo(found.checksum_algo)
            ) from None
        size = 0
        with _beside(target) as tmp:
            out_fd = create_file(str(tmp), mode)
            os.fchmod(out_fd, mode)  # a leftover at the temporary name keeps its own
            with copy.store.open_read(tag, found.file) as stream, open(out_fd, "wb") as out:
                while chunk := stream.read(_CHUNK_BYTES):
                    hasher.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    advance(size)
                out.flush()
                os.fsync(out.fileno())
            actual = hasher.hexdigest()
            if size != found.size_bytes or actual != found.checksum:
                advance(0)
                raise CorruptCheckpointError(
                    where, expected, f"{size} bytes with {found.checksum_algo} {actual}"
                )
            os.replace(tmp, target)
        return _record(found, target, reused=False)

    return find_copy(tiers, tag, write, item=entry.name, lease=True,
                     report=(CorruptCheckpointError,))  # fmt: skip


def _non_tensors_error(tag: str, name: str, others: list[str]) -> InvalidArgumentError:
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    return InvalidArgumentError(
        f"item {name!r} of {tag!r} holds values that are not tensors ({shown}); safetensors "
        "holds tensors only: drop them (drop_non_tensors=True, nebula export "
        "--drop-non-tensors) or export to pt"
    )


def _refuse_non_tensors(root: PathLike, tag: str, name: str) -> None:
    """Raise before anything is written when item `name` holds more than tensors (read
    from its pickle's metadata: nothing is executed, no tensor data read)."""
    from nebulaml.ops.inspection import describe_item

    others = [
        e["path"] or "(item)" for e in describe_item(root, tag, name) if e["kind"] != "tensor"
    ]
    if others:
        raise _non_tensors_error(tag, name, others)


def _safetensors_header(path: Path) -> tuple[dict[str, str], int]:
    """The metadata of a safetensors file and how many tensors it holds (nothing if it is
    not one)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as stream:
            return dict(stream.metadata() or {}), len(stream.keys())
    except Exception:  # noqa: BLE001 - not a safetensors file (or not readable): not ours
        return {}, 0


def _export_safetensors(tiers: Any, tag: str, entry: ItemEntry, target: Path, overwrite: bool,
                        drop_non_tensors: bool, mode: int) -> dict[str, Any]:  # fmt: skip
    from safetensors.torch import save_file

    source = {"nebula_tag": tag, "nebula_item": entry.name,
              "nebula_checksum": f"{entry.checksum_algo}:{entry.checksum}"}  # fmt: skip
    if target.is_file():
        metadata, count = _safetensors_header(target)
        if metadata.items() >= source.items():  # written from these very bytes
            try:
                dropped = load_json(metadata.get("nebula_dropped", "[]"))
            except JsonBoundsError:
                dropped = None  # not what nebula writes: the file is not reused
            if isinstance(dropped, list) and (drop_non_tensors or not dropped):
                return _record(entry, target, reused=True, tensors=count, dropped=dropped)
    _refuse_existing(target, entry, tag, overwrite)
    obj = load_item(tiers, tag, entry.name, map_location="cpu", weights_only=True)
    tensors, others = flatten_tensors(obj)
    if others and not drop_non_tensors:
        raise _non_tensors_error(tag, entry.name, others)
    with _beside(target) as tmp:
        metadata = {**source, "nebula_dropped": json.dumps(others)}
        save_file(_unshared(tensors), str(tmp), metadata=metadata)
        os.chmod(tmp, mode, follow_symlinks=False)  # safetensors writes 0600
        os.replace(tmp, target)
    return _record(entry, target, reused=False, tensors=len(tensors), dropped=others)


def flatten_tensors(obj: Any, prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """The tensors inside `obj` by dotted path (dict keys and list indices joined with
    "."), and the paths of the leaves that are not tensors, in the order they are held.

    Example:
        >>> import torch
        >>> tensors, others = flatten_tensors({"w": torch.ones(1), "opt": [{"lr": 0.1}]})
        >>> list(tensors), others
        (['w'], ['opt.0.lr'])
    """
    import torch

    tensors: dict[str, Any] = {}
    others: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if path in tensors:
                raise InvalidArgumentError(f"two tensors have the path {path!r}")
            tensors[path or "tensor"] = value
        elif isinstance(value, Mapping):
            for key, inner in value.items():
                walk(inner, f"{path}.{key}" if path else str(key))
        elif isinstance(value, (list, tuple)):
            for index, inner in enumerate(value):
                walk(inner, f"{path}.{index}" if path else str(index))
        else:
            others.append(path or "(item)")

    walk(obj, prefix)
    return tensors, others


def _unshared(tensors: dict[str, Any]) -> dict[str, Any]:
    """Tensors safetensors accepts: contiguous, on the CPU, none sharing memory with
    another (a view or a tied weight is copied)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen and storage.nbytes():
            tensor = tensor.clone()
        seen.add(key)
        out[name] = tensor.contiguous()
    return out
