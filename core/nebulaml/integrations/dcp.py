"""PyTorch Distributed Checkpoint (DCP) through nebula: a `StorageWriter` and a
`StorageReader` whose checkpoint is one nebula checkpoint (public as `nebulaml.dcp`).

A DCP save on every rank (`dcp.save` or `dcp.async_save`) commits ONE nebula checkpoint,
through nebula's rank markers: each rank opens `Checkpoint(tag, num_of_files=-2)`, saves its
part and commits; the manifest is published once every rank's part is there. So the
checkpoint has nebula's checksums, memory tier, persister, retention, leases and CLI.

The items of a DCP checkpoint:

    dcp_rank<r>     rank r's part: a dict {key: tensor} of what DCP asked that rank to
                    write, one entry per write item (a shard of a DTensor or ShardedTensor,
                    a plain tensor, or a pickled object); `torch.load(path,
                    weights_only=True)` reads it. A tensor's key is its fully qualified
                    name ("model.0.weight", "optim.state.0.weight.exp_avg"), with
                    "@<offsets>" when the rank writes several chunks of it. A non-tensor
                    value (DCP's BYTE_IO: `torch.save` bytes of e.g. a learning rate) is a
                    uint8 tensor of those bytes.
    dcp_metadata    the coordinator's (rank 0 of DCP's group): DCP's `Metadata` as plain
                    data, so that it too loads with weights_only=True: every tensor's
                    global size, dtype and chunks (offsets and sizes), the planner's data,
                    and `storage_data` (which item and key hold each chunk).

Why a dict of tensors rather than raw concatenated bytes as DCP's FileSystemWriter writes:
a nebula item is a torch zip file, checked (size and xxh3 checksum) before anything is
unpickled, and it stays a file that plain torch.load reads, that `nebula inspect` describes
tensor by tensor, and that nebula's snapshot path writes into reused memory-tier buffers
(hashing on the way). A chunk is located by (item, key) instead of (file, offset,
length); the reader loads an item (verified, mapped where it can be) and narrows it.

The commit inside `write_data`: DCP calls `finish(metadata, results)` on its coordinator
only, after every rank's `write_data` has returned; a rank that waited in `write_data` for
the coordinator's commit would wait forever. Since an item and its key are fixed when the
global plan is made (`prepare_global_plan`, on the coordinator), the coordinator knows
`storage_data` before any byte is written, and takes the global metadata from the planner
(`planner.metadata`, which DefaultSavePlanner and its subclasses keep). So every rank
saves its part and commits in `write_data`; the coordinator also saves `dcp_metadata`
there, and `finish` checks that the results are what was recorded.

Loading verifies each item, refuses pickled values that need code execution (DCP's own
reader unpickles them with weights_only=False; `Reader(weights_only=False)` allows that
for a trusted checkpoint), and reshards as DCP does: any number of ranks, any sharding.

May import: everything (it is an integration), torch.distributed.checkpoint included.
Not for: nebula's own save and commit (runtime/save.py, protocol/commit.py).
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from nebulaml.api import get_checkpoint, get_latest_checkpoint
from nebulaml.checkpoint import MANUAL_COMMIT, Checkpoint
from nebulaml.errors import (
    CheckpointNotFoundError,
    CheckpointStateError,
    CorruptCheckpointError,
    InvalidArgumentError,
    UnsupportedSchemaError,
)
from nebulaml.format.names import validate_name
from nebulaml.format.serialization import read_item
from nebulaml.runtime import session as _session
from nebulaml.runtime.locate import tiers_for

METADATA_ITEM = "dcp_metadata"
DATA_PREFIX = "dcp_rank"
FORMAT = "nebulaml.dcp"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
DCP_VERSION = "1.0.0"  # the version of DCP's format that FileSystemWriter records
# TensorProperties fields whose values are torch objects, stored by name ("float32").
_TORCH_VALUED = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


def data_item(rank: int) -> str:
    """The item that holds rank `rank`'s part of a DCP checkpoint.

    Example:
        >>> data_item(3)
        'dcp_rank3'
    """
    return f"{DATA_PREFIX}{rank}"


@dataclass(frozen=True)
class ItemRef:
    """Where DCP's storage_data says one chunk is: key `key` of the nebula item `item`."""

    item: str
    key: str


@dataclass(frozen=True)
class _RankPart:
    """A save plan's storage_data: the rank's item, and (once the global plan is made) the
    key of each of its write items."""

    item: str
    keys: dict[MetadataIndex, str] = dataclasses.field(default_factory=dict)


def _tag_of(checkpoint_id: Any, what: str) -> str:
    if isinstance(checkpoint_id, os.PathLike):
        raise InvalidArgumentError(
            f"{what}: checkpoint_id must be a nebula tag (a name such as 'global_step500'), "
            f"not a path ({os.fspath(checkpoint_id)!r}); the root is the one of nm.init"
        )
    return validate_name("tag", checkpoint_id)


# saving ------------------------------------------------------------------------------
class Writer(StorageWriter):
    """A DCP StorageWriter into the nebula checkpoint `tag`.

    `dcp.save(state, storage_writer=Writer(tag))` (or `dcp.async_save`) on every rank of
    the job commits one checkpoint in the memory tier, persisted in the background as any
    nebula checkpoint; `dcp.save(state, checkpoint_id=tag, storage_writer=Writer())`
    names the tag per save. A committed tag is refused unless `overwrite=True`; `labels`
    (e.g. `["best"]`) are recorded and kept by retention. Needs `nm.init` on every rank,
    and DCP's process group must hold every rank of the job (a nebula checkpoint commits
    once every rank's part is there).
    """

    def __init__(
        self,
        tag: str | None = None,
        *,
        overwrite: bool = False,
        labels: Iterable[str] = (),
    ) -> None:
        super().__init__()
        self.tag: str | None = None if tag is None else _tag_of(tag, "nebulaml.dcp.Writer")
        self.overwrite = overwrite
        self.labels: tuple[str, ...] = tuple(validate_name("label", x) for x in labels)
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex
        self._refs: dict[MetadataIndex, ItemRef] = {}  # the coordinator's, from the global plan
        self._written: Metadata | None = None  # what the coordinator saved as dcp_metadata

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.tag = _tag_of(checkpoint_id, "nebulaml.dcp.Writer")
        self.save_id = uuid.uuid4().hex
        self._refs, self._written = {}, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgumentError(
                "nebulaml.dcp.Writer needs DCP's collectives (use_collectives=True): a nebula "
                "checkpoint is one manifest over every rank's part, with one metadata item"
            )
        self.is_coordinator = is_coordinator
        self._refs, self._written = {}, None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.tag, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._need_tag()
        session = _session.current("nebulaml.dcp.Writer")
        return dataclasses.replace(plan, storage_data=_RankPart(data_item(session.rank)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        session = _session.current("nebulaml.dcp.Writer")
        if not all(plan.usable for plan in plans):
            raise InvalidArgumentError(
                "nebulaml.dcp.Writer does not support DCP's plan caching "
                "(DefaultSavePlanner(enable_plan_caching=True))"
            )
        parts = [plan.storage_data for plan in plans]
        items = sorted(p.item for p in parts if isinstance(p, _RankPart))
        expected = sorted(data_item(rank) for rank in range(session.world_size))
        if items != expected:
            raise InvalidArgumentError(
                f"nebulaml.dcp.Writer: DCP's process group has {len(plans)} rank(s) and "
                f"nebula's job {session.world_size}; a nebula checkpoint commits once every "
                f"rank of the job saved its part, so dcp.save must run on every rank, over "
                f"the default process group (no_dist=True only in a single-process job)"
            )
        out = []
        refs: dict[MetadataIndex, ItemRef] = {}
        for plan, part in zip(plans, parts, strict=True):
            assert isinstance(part, _RankPart)
            keys = _keys_for(plan.items)
            refs.update((index, ItemRef(part.item, key)) for index, key in keys.items())
            out.append(dataclasses.replace(plan, storage_data=_RankPart(part.item, keys)))
        self._refs = refs
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        tag = self._need_tag()
        part = plan.storage_data
        if not isinstance(part, _RankPart) or len(part.keys) != len(plan.items):
            raise CheckpointStateError(
                "nebulaml.dcp.Writer.write_data: the plan was not prepared by this writer"
            )
        tensors: dict[str, torch.Tensor] = {}
        results = []
        for item in plan.items:
            key = part.keys[item.index]
            tensor, length = _as_tensor(item, planner.resolve_data(item))
            tensors[key] = tensor
            results.append(WriteResult(item.index, length, ItemRef(part.item, key)))
        metadata, record = None, None
        if self.is_coordinator:  # checked before anything is written
            metadata = self._metadata(planner)
            record = encode_metadata(metadata)
        ckpt = Checkpoint(tag, MANUAL_COMMIT, overwrite=self.overwrite, labels=self.labels)
        ckpt.save(part.item, tensors)
        del tensors
        if record is not None:
            ckpt.save(METADATA_ITEM, record)
            self._written = metadata
        ckpt.commit()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Committed already (write_data): check that DCP's results are what the metadata
        item records, and complete DCP's `metadata` (what dcp.save returns) the same way."""
        written = self._written
        if written is None:
            raise CheckpointStateError(
                "nebulaml.dcp.Writer.finish: the coordinator wrote no metadata item"
            )
        for result in (r for rank in results for r in rank):
            if written.storage_data.get(result.index) != result.storage_data:
                raise CheckpointStateError(
                    f"checkpoint {self.tag!r}: DCP reports {result.index.fqn!r} written "
                    f"at {result.storage_data}, and its metadata item says "
                    f"{written.storage_data.get(result.index)}"
                )
        if metadata.state_dict_metadata != written.state_dict_metadata:
            raise CheckpointStateError(
                f"checkpoint {self.tag!r}: DCP's final metadata differs from the planner's "
                f"that the metadata item records"
            )
        metadata.storage_data = written.storage_data
        metadata.storage_meta = written.storage_meta
        metadata.version = written.version

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_tag(checkpoint_id)

    def _need_tag(self) -> str:
        if self.tag is None:
            raise InvalidArgumentError(
                "nebulaml.dcp.Writer has no tag: Writer('global_step500'), or "
                "dcp.save(..., checkpoint_id='global_step500', storage_writer=Writer())"
            )
        return self.tag

    def _metadata(self, planner: SavePlanner) -> Metadata:
        """The global metadata of this save, complete: the planner's, with where each
        chunk goes."""
        metadata = getattr(planner, "metadata", None)
        if not isinstance(metadata, Metadata):
            raise InvalidArgumentError(
                f"nebulaml.dcp.Writer needs the planner's global metadata before the data is "
                f"written (planner.metadata, as DefaultSavePlanner and its subclasses keep "
                f"it); {type(planner).__name__} has none"
            )
        missing = [
            index.fqn for index in _indexes(metadata.state_dict_metadata) if index not in self._refs
        ]
        if missing:
            raise CheckpointStateError(
                f"checkpoint {self.tag!r}: no rank writes {', '.join(sorted(set(missing))[:5])}"
            )
        return dataclasses.replace(
            metadata,
            storage_data=dict(self._refs),
            storage_meta=self.storage_meta(),
            version=DCP_VERSION,
        )


def _keys_for(items: list[WriteItem]) -> dict[MetadataIndex, str]:
    """Each write item's key in the rank's item: its fqn, with its chunk's offsets when
    the rank writes several chunks of one tensor."""
    count = Counter(item.index.fqn for item in items)
    keys: dict[MetadataIndex, str] = {}
    taken: set[str] = set()
    for item in items:
        index = item.index
        key = index.fqn
        if count[index.fqn] > 1 and index.offset is not None:
            key = f"{index.fqn}@{'_'.join(map(str, index.offset))}"
        base, n = key, 1
        while key in taken:
            key, n = f"{base}#{n}", n + 1
        taken.add(key)
        keys[index] = key
    return keys


def _as_tensor(item: WriteItem, data: Any) -> tuple[torch.Tensor, int]:
    """What the rank's item holds for `item` (DCP's resolved data), and its length."""
    if item.type == WriteItemType.BYTE_IO:
        payload = bytearray(data.getbuffer())
        if not payload:
            return torch.empty(0, dtype=torch.uint8), 0
        return torch.frombuffer(payload, dtype=torch.uint8), len(payload)
    if not isinstance(data, torch.Tensor):
        raise InvalidArgumentError(
            f"{item.index.fqn!r}: DCP resolved a {type(data).__name__}, not a tensor"
        )
    tensor = data.detach()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        # A view of a larger storage (a shard of a flat buffer): torch.save would write the
        # whole storage. As DCP's own writer, save just this tensor's bytes.
        tensor = tensor.clone()
    return tensor, tensor.nbytes


def _indexes(entries: dict[str, Any]) -> list[MetadataIndex]:
    """The MetadataIndex of every chunk (or value) of the state dict's metadata."""
    out: list[MetadataIndex] = []
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            out.extend(MetadataIndex(fqn, chunk.offsets) for chunk in entry.chunks)
        else:
            out.append(MetadataIndex(fqn))
    return out


def _is_tag(checkpoint_id: Any) -> bool:
    try:
        validate_name("tag", checkpoint_id)
    except InvalidArgumentError:
        return False
    return True


# the metadata item -----------------------------------------------------------------------
def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """DCP's `Metadata` as plain data (lists, dicts, strings, numbers), which
    `torch.load(weights_only=True)` reads; `decode_metadata` makes it back."""
    entries: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            entries[fqn] = {
                "type": "tensor",
                "size": list(entry.size),
                "properties": _encode_properties(entry.properties),
                "chunks": [
                    {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)}
                    for chunk in entry.chunks
                ],
            }
        elif isinstance(entry, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
        else:
            raise InvalidArgumentError(
                f"{fqn!r}: DCP storage metadata of type {type(entry).__name__} is not known "
                f"to nebulaml.dcp"
            )
    storage = [
        {
            "fqn": index.fqn,
            "offset": None if index.offset is None else list(index.offset),
            "item": ref.item,
            "key": ref.key,
        }
        for index, ref in metadata.storage_data.items()
    ]
    meta = metadata.storage_meta
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dcp_version": metadata.version,
        "state_dict_metadata": entries,
        "storage_data": storage,
        "planner_data": _plain(metadata.planner_data, "the planner's data"),
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
            "save_id": meta.save_id,
            "modules": list(meta.modules),
        },
    }


def decode_metadata(doc: Any, where: str) -> Metadata:
    """DCP's `Metadata` from the metadata item's plain data (`encode_metadata`)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CorruptCheckpointError(where, f"a {FORMAT} metadata record", repr(found))
    if doc.get("format_version") not in SUPPORTED_VERSIONS:
        raise UnsupportedSchemaError(where, doc.get("format_version"), SUPPORTED_VERSIONS)
    try:
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, entry in doc["state_dict_metadata"].items():
            if entry["type"] == "bytes":
                entries[fqn] = BytesStorageMetadata()
                continue
            if entry["type"] != "tensor":
                raise ValueError(f"{fqn!r} has type {entry['type']!r}")
            entries[fqn] = TensorStorageMetadata(
                properties=_decode_properties(entry["properties"]),
                size=torch.Size(entry["size"]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(chunk["offsets"]), sizes=torch.Size(chunk["sizes"])
                    )
                    for chunk in entry["chunks"]
                ],
            )
        storage = {
            MetadataIndex(row["fqn"], row["offset"]): ItemRef(
                validate_name("item", row["item"]), str(row["key"])
            )
            for row in doc["storage_data"]
        }
        meta = doc.get("storage_meta") or {}
        storage_meta = StorageMeta(
            checkpoint_id=meta.get("checkpoint_id"),
            save_id=meta.get("save_id"),
            modules=list(meta.get("modules") or []),
        )
    except (KeyError, TypeError, ValueError, AttributeError, InvalidArgumentError) as exc:
        raise CorruptCheckpointError(where, f"a {FORMAT} metadata record", repr(exc)) from None
    return Metadata(
        state_dict_metadata=entries,
        planner_data=doc.get("planner_data"),
        storage_data=storage,
        storage_meta=storage_meta,
        version=doc.get("dcp_version"),
    )


def _encode_properties(properties: TensorProperties) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in dataclasses.fields(properties):
        value = getattr(properties, field.name)
        if field.name in _TORCH_VALUED:
            out[field.name] = str(value).removeprefix("torch.")
        elif isinstance(value, (bool, int, float, str, type(None))):
            out[field.name] = value
        else:
            raise InvalidArgumentError(
                f"tensor property {field.name}={value!r} cannot be recorded by nebulaml.dcp"
            )
    return out


def _decode_properties(record: dict[str, Any]) -> TensorProperties:
    known = {field.name for field in dataclasses.fields(TensorProperties)}
    kwargs: dict[str, Any] = {}
    for name, value in record.items():
        if name not in known:
            continue  # a field of another torch version's DCP
        if name in _TORCH_VALUED:
            resolved = getattr(torch, str(value), None)
            if not isinstance(resolved, _TORCH_VALUED[name]):
                raise ValueError(f"{name} {value!r} is not a torch {name}")
            value = resolved
        kwargs[name] = value
    return TensorProperties(**kwargs)


def _plain(value: Any, what: str) -> Any:
    """`value` if it is plain data (what weights_only=True loads), else a clear error."""
    stack = [value]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            stack.extend(cur.keys())
            stack.extend(cur.values())
        elif isinstance(cur, (list, tuple)):
            stack.extend(cur)
        elif not isinstance(cur, (str, int, float, bool, type(None))):
            raise InvalidArgumentError(
                f"nebulaml.dcp records {what} as plain data, and it holds a "
                f"{type(cur).__name__}; use DCP's DefaultSavePlanner"
            )
    return value


# loading -------------------------------------------------------------------------------
class Reader(StorageReader):
    """A DCP StorageReader from the nebula checkpoint `tag` (the newest if None).

    `dcp.load(state, storage_reader=Reader(tag))` loads in place, resharding as DCP does:
    a checkpoint saved on N ranks loads on any number, with any sharding. Each item is
    read from the fastest tier that holds it, verified first, under a read lease.
    `persist_path` reads another root than nm.init's. Pickled (non-tensor) values are
    refused if they would execute code, unless `weights_only=False` (a trusted checkpoint).
    With `tag=None` each rank looks for the newest checkpoint itself: name the tag where
    a save may commit meanwhile.
    """

    def __init__(
        self,
        tag: str | None = None,
        *,
        persist_path: str | os.PathLike[str] | None = None,
        weights_only: bool = True,
    ) -> None:
        super().__init__()
        self.requested: str | None = None if tag is None else _tag_of(tag, "nebulaml.dcp.Reader")
        self.tag: str | None = self.requested  # the tag being read (set by read_metadata)
        self.persist_path = persist_path
        self.weights_only = weights_only
        self.storage_data: dict[MetadataIndex, ItemRef] = {}
        self._handle: Checkpoint | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.requested = _tag_of(checkpoint_id, "nebulaml.dcp.Reader")
        self.tag, self.storage_data, self._handle = self.requested, {}, None

    def read_metadata(self, *args: Any) -> Metadata:
        self._handle = None  # looked up again: Reader() reads the newest at each load
        handle = self._checkpoint(self.requested)
        where = f"{handle.tag}/{METADATA_ITEM}"
        metadata = decode_metadata(handle.load(METADATA_ITEM, map_location="cpu"), where)
        assert metadata.storage_meta is not None
        metadata.storage_meta.checkpoint_id = handle.tag  # what every rank reads
        metadata.storage_meta.load_id = uuid.uuid4().hex
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        storage = metadata.storage_data
        if not isinstance(storage, dict) or not all(
            isinstance(ref, ItemRef) for ref in storage.values()
        ):
            raise InvalidArgumentError(
                "nebulaml.dcp.Reader reads metadata of nebulaml.dcp checkpoints only"
            )
        self.storage_data = storage
        # Every rank reads the checkpoint whose metadata it was given.
        tag = metadata.storage_meta.checkpoint_id if metadata.storage_meta else None
        if isinstance(tag, str):
            if self._handle is not None and self._handle.tag != tag:
                self._handle = None
            self.tag = tag

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_item: dict[str, list[Any]] = {}
        for request in plan.items:
            per_item.setdefault(self.storage_data[request.storage_index].item, []).append(request)
        handle = self._checkpoint(self.tag)
        for name, requests in per_item.items():
            where = f"{handle.tag}/{name}"
            stored = handle.load(name, map_location="cpu")
            if not isinstance(stored, dict):
                raise CorruptCheckpointError(where, "a dict of tensors", type(stored).__name__)
            for request in requests:
                key = self.storage_data[request.storage_index].key
                value = stored.get(key)
                if not isinstance(value, torch.Tensor):
                    raise CorruptCheckpointError(where, f"a tensor at key {key!r}", repr(value))
                if request.type == LoadItemType.BYTE_IO:
                    payload = value.numpy().tobytes()
                    if self.weights_only:
                        read_item(payload, f"{where}[{key!r}]", weights_only=True)
                    planner.load_bytes(request, io.BytesIO(payload))
                    continue
                tensor = narrow_tensor_by_index(value, request.storage_offsets, request.lengths)
                target = planner.resolve_tensor(request).detach()
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(
                        f"{where}[{key!r}]",
                        f"a chunk of size {tuple(target.size())}",
                        f"size {tuple(tensor.size())}",
                    )
                target.copy_(tensor)
                planner.commit_tensor(request, target)
            del stored
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_tag(checkpoint_id)

    def _checkpoint(self, tag: str | None) -> Checkpoint:
        """The committed checkpoint `tag` (the newest if None), found once per load."""
        if self._handle is not None and (tag is None or self._handle.tag == tag):
            return self._handle
        if tag is None:
            found = get_latest_checkpoint(self.persist_path)
        else:
            found = get_checkpoint(tag, self.persist_path)
        if found is None:
            where = tiers_for(self.persist_path, "nebulaml.dcp.Reader").display
            raise CheckpointNotFoundError(where, tag)
        self._handle, self.tag = found, found.tag
        return found
