"""manifest.json: the record whose presence, valid, means "committed" (docs/architecture.md,
"On disk").

This module turns manifests and rank markers into JSON and back, and refuses anything it
cannot trust: unknown schema versions, missing fields, file names that leave the tag folder,
documents too large or too deeply nested to parse safely (jsonbounds.py). It also checks
an item's bytes against its entry (`verify_bytes`).

Manifest schemas: 1, the first release; 2 adds `sequence`, the checkpoint's place in the
commit order of its root (see `Manifest`). Both are read; 2 is written. Rank markers are
still written as 1: what was added to them since (`generation`, `reused`) is optional, and
a reader that does not know a field passes over it.

May import: `nebulaml.errors`, `nebulaml.format.names`, `nebulaml.format.jsonbounds` and
`nebulaml.format.checksum` (the algorithms an entry names). Not for: computing checksums
(checksum.py), or reading or writing storage (protocol/catalog.py and protocol/commit.py
do that).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import xxhash

from nebulaml.errors import CorruptCheckpointError, ManifestError, UnsupportedSchemaError
from nebulaml.format.checksum import (
    CHECKSUM_ALGO,
    KNOWN_CHECKSUM_ALGOS,
    checksum_of,
    unknown_algo,
)
from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, JsonBoundsError, load_json
from nebulaml.format.names import OrderKey, order_key, validate_name

SCHEMA_VERSION = 2
SUPPORTED_SCHEMAS = (1, 2)
MARKER_SCHEMA_VERSION = 1
# Item files name their algorithm (`CHECKSUM_ALGO`, or a legacy one: checksum.py). A
# manifest seals itself with plain xxh3.
SEAL_ALGO = "xxh3_64"


@dataclass(frozen=True, slots=True)
class ItemEntry:
    """One saved item: a file in the tag folder, written by one rank."""

    name: str
    file: str
    rank: int
    size_bytes: int
    checksum_algo: str
    checksum: str
    tensor_bytes: int

    @classmethod
    def written(
        cls, name: str, *, rank: int, size_bytes: int, checksum: str, tensor_bytes: int
    ) -> ItemEntry:
        """The entry of an item this nebula has just written: file `name`, checksum
        under `CHECKSUM_ALGO`."""
        return cls(name, name, rank, size_bytes, CHECKSUM_ALGO, checksum, tensor_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "rank": self.rank,
            "size_bytes": self.size_bytes,
            "checksum": {"algo": self.checksum_algo, "value": self.checksum},
            "tensor_bytes": self.tensor_bytes,
        }


def verify_bytes(
    where: str, entry: ItemEntry, data: bytes | memoryview, checksum: str | None = None
) -> None:
    """Check an item's bytes against its manifest entry before anything unpickles them;
    a mismatch, or a checksum algorithm this nebula does not know, raises
    `CorruptCheckpointError` naming `where`. `checksum`: the bytes' checksum under the
    entry's algorithm, already taken while they were read (else they are hashed here)."""
    expected = f"{entry.size_bytes} bytes with {entry.checksum_algo} {entry.checksum}"
    if entry.checksum_algo not in KNOWN_CHECKSUM_ALGOS:
        raise CorruptCheckpointError(where, expected, unknown_algo(entry.checksum_algo))
    actual = checksum if checksum is not None else checksum_of(data, entry.checksum_algo)
    if len(data) != entry.size_bytes or actual != entry.checksum:
        raise CorruptCheckpointError(
            where, expected, f"{len(data)} bytes with {entry.checksum_algo} {actual}"
        )


@dataclass(frozen=True, slots=True)
class Producer:
    """Who wrote a manifest (for humans and bug reports; never trusted for logic)."""

    nebula_version: str
    torch_version: str
    host: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """A committed checkpoint's table of contents (schema_version 2; 1 is read too).

    `sequence` orders checkpoints whose tags name no step, or the same one, without a
    clock: at its commit on a root a checkpoint gets 1 + the highest sequence there
    (protocol/sequence.py), and a copy keeps it unless the destination already holds a
    higher one (protocol/transfer.py). 0: none recorded (a schema 1 manifest), older than
    any that has one. `committed_at` is for people, and only the last tie-break.

    Example:
        >>> m = Manifest(tag="global_step5", step=5, created_at="2026-01-01T00:00:00Z",
        ...              committed_at="2026-01-01T00:00:01Z", world_size=1, items=(),
        ...              producer=Producer("0.1.0", "2.13.0", "h"))
        >>> parse_manifest(m.to_bytes(), "x").tag
        'global_step5'
    """

    tag: str
    step: int | None
    created_at: str
    committed_at: str
    world_size: int
    items: tuple[ItemEntry, ...]
    producer: Producer
    labels: tuple[str, ...] = field(default=())
    schema_version: int = SCHEMA_VERSION
    # The ranks that wrote it, when not every rank of the job did (`Checkpoint(tag,
    # ranks=[0])`); None (and no field in the file) means all `world_size` ranks.
    ranks: tuple[int, ...] | None = None
    sequence: int = 0

    @property
    def writers(self) -> tuple[int, ...]:
        """The ranks that wrote this checkpoint's parts."""
        return writer_ranks(self.ranks, self.world_size)

    @property
    def sort_key(self) -> OrderKey:
        """This checkpoint's place in "newest" order (names.order_key)."""
        return order_key(self.tag, self.committed_at, self.sequence)

    @property
    def total_bytes(self) -> int:
        return sum(item.size_bytes for item in self.items)

    def item(self, name: str) -> ItemEntry | None:
        return next((item for item in self.items if item.name == name), None)

    def to_json(self) -> dict[str, Any]:
        """The manifest document, sealed with its own checksum (see `seal`)."""
        return json.loads(self.to_bytes())

    def _fields(self) -> dict[str, Any]:
        doc = {
            "schema_version": self.schema_version,
            "tag": self.tag,
            "step": self.step,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "world_size": self.world_size,
            "items": [item.to_json() for item in self.items],
            "total_bytes": self.total_bytes,
            "producer": asdict(self.producer),
            "labels": list(self.labels),
        }
        if self.ranks is not None:
            doc["ranks"] = list(self.ranks)
        if self.schema_version >= 2:
            doc["sequence"] = self.sequence
        return doc

    def to_bytes(self) -> bytes:
        return seal(self._fields())


def _require(doc: dict[str, Any], key: str, kinds: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise ManifestError(where, f"manifest has no {key!r} field")
    value = doc[key]
    # bool is an int subclass; a boolean where a count belongs is corruption, not a count.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        raise ManifestError(where, f"manifest field {key!r} has the wrong type")
    return value


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _parse_item(doc: Any, where: str) -> ItemEntry:
    if not isinstance(doc, dict):
        raise ManifestError(where, "manifest item is not an object")
    if set(doc) - _ITEM_KEYS:
        raise ManifestError(
            where, f"manifest item has unknown field(s) {sorted(set(doc) - _ITEM_KEYS)}"
        )
    name = _require(doc, "name", str, where)
    file = _require(doc, "file", str, where)
    try:
        validate_name("item", name)
        validate_name("item", file)
    except ValueError as exc:
        raise ManifestError(where, f"manifest lists an unsafe item: {exc}") from exc
    checksum = _require(doc, "checksum", dict, where)
    algo, value = checksum.get("algo"), checksum.get("value")
    if not isinstance(algo, str) or not isinstance(value, str):
        raise ManifestError(where, f"item {name!r} has no valid checksum")
    size = _require(doc, "size_bytes", int, where)
    rank = _require(doc, "rank", int, where)
    tensor_bytes = _require(doc, "tensor_bytes", int, where)
    if size < 0 or rank < 0 or tensor_bytes < 0:
        raise ManifestError(where, f"item {name!r} has a negative size or rank")
    return ItemEntry(name, file, rank, size, algo, value, tensor_bytes)


_MANIFEST_KEYS = frozenset(
    {"schema_version", "tag", "step", "created_at", "committed_at", "world_size", "items",
     "total_bytes", "producer", "labels", "checksum", "ranks", "sequence"}
)  # fmt: skip
_ITEM_KEYS = frozenset({"name", "file", "rank", "size_bytes", "checksum", "tensor_bytes"})


def _self_checksum(doc: dict[str, Any]) -> str:
    body = {key: value for key, value in doc.items() if key != "checksum"}
    canonical = _CANONICAL.encode(body)
    return xxhash.xxh3_64(canonical.encode()).hexdigest()


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def seal(doc: dict[str, Any]) -> bytes:
    """A manifest document as bytes, with its own checksum (xxh3 over the canonical JSON
    of every other field), so that any change to a committed manifest is detected.

    Example:
        >>> json.loads(seal({"tag": "t"}))["checksum"]["algo"]
        'xxh3_64'
    """
    doc = {**doc, "checksum": {"algo": SEAL_ALGO, "value": _self_checksum(doc)}}
    return _readable(doc).encode()


def _readable(doc: dict[str, Any]) -> str:
    """`doc` as JSON a person reads: one field per line, keys sorted, and a list of
    objects (the items) one object per line. Each value is encoded by json's C encoder
    (`indent=` takes its pure-Python one: ~500 calls for a manifest, in the commit).

    Example:
        >>> print(_readable({"tag": "t", "items": [{"b": 1, "a": 2}], "labels": []}), end="")
        {
          "items": [
            {"a": 2, "b": 1}
          ],
          "labels": [],
          "tag": "t"
        }
    """
    encode = _SORTED.encode
    fields = []
    for key in sorted(doc):
        value = doc[key]
        if isinstance(value, list) and value and all(type(v) is dict for v in value):
            rows = ",\n    ".join([encode(v) for v in value])
            text = f"[\n    {rows}\n  ]"
        else:
            text = encode(value)
        fields.append(f"  {encode(key)}: {text}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


_SORTED = json.JSONEncoder(sort_keys=True)  # one encoder: json.dumps makes one per call


def _check_seal(doc: dict[str, Any], where: str) -> None:
    unknown = sorted(set(doc) - _MANIFEST_KEYS)
    if unknown:
        raise ManifestError(where, f"manifest has unknown field(s) {', '.join(unknown)}")
    checksum = _require(doc, "checksum", dict, where)
    if checksum.get("algo") != SEAL_ALGO or checksum.get("value") != _self_checksum(doc):
        raise ManifestError(where, "manifest does not match its own checksum (it was altered)")


def _check_schema(doc: dict[str, Any], where: str) -> int:
    """The schema of the manifest or marker `doc` if this nebula reads it. A schema newer
    than this nebula reads is `UnsupportedSchemaError` (upgrade), naming the nebula its
    producer says wrote it; a missing, malformed or impossible one (below 1) is
    corruption, a `ManifestError`."""
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ManifestError(where, f"manifest has no valid schema_version ({version!r})")
    if version not in SUPPORTED_SCHEMAS:
        producer = doc.get("producer")
        writer = producer.get("nebula_version") if isinstance(producer, dict) else None
        written_by = writer[:40] if isinstance(writer, str) and writer.isprintable() else None
        raise UnsupportedSchemaError(where, version, SUPPORTED_SCHEMAS, written_by or None)
    return version


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; `where` names the file in error messages.

    Raises `UnsupportedSchemaError` for a schema this version cannot read and
    `ManifestError` for anything malformed.
    """
    doc = _json_object(data, where, "manifest")
    version = _check_schema(doc, where)
    tag = _require(doc, "tag", str, where)
    try:
        validate_name("tag", tag)
    except ValueError as exc:
        raise ManifestError(where, f"manifest names an unsafe tag: {exc}") from exc
    step = doc.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise ManifestError(where, "manifest field 'step' has the wrong type")
    items = tuple(_parse_item(item, where) for item in _require(doc, "items", list, where))
    names = [item.name for item in items]
    files = [item.file for item in items]
    if len(set(names)) != len(names) or len(set(files)) != len(files):
        raise ManifestError(where, "manifest lists an item or file twice")
    total = _require(doc, "total_bytes", int, where)
    if total != sum(item.size_bytes for item in items):
        raise ManifestError(where, "manifest total_bytes does not match its items")
    producer_doc = _require(doc, "producer", dict, where)
    producer = Producer(
        nebula_version=str(producer_doc.get("nebula_version", "")),
        torch_version=str(producer_doc.get("torch_version", "")),
        host=str(producer_doc.get("host", "")),
    )
    labels = doc.get("labels", [])
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise ManifestError(where, "manifest field 'labels' has the wrong type")
    world_size = _require(doc, "world_size", int, where)
    if world_size < 1:
        raise ManifestError(where, "manifest world_size is below 1")
    ranks = _parse_ranks(doc, world_size, where)
    if ranks is not None and any(item.rank not in ranks for item in items):
        raise ManifestError(where, "manifest lists an item of a rank that did not write")
    sequence = _parse_sequence(doc, version, where)
    _check_seal(doc, where)  # last: the structural errors above say more
    return Manifest(
        tag=tag,
        step=step,
        created_at=_require(doc, "created_at", str, where),
        committed_at=_require(doc, "committed_at", str, where),
        world_size=world_size,
        items=items,
        producer=producer,
        labels=tuple(labels),
        schema_version=version,
        ranks=ranks,
        sequence=sequence,
    )


def _parse_sequence(doc: dict[str, Any], version: int, where: str) -> int:
    """A schema 2 manifest's `sequence` (an int, 0 or more); a schema 1 one has none (0)."""
    if version < 2:
        if "sequence" in doc:
            raise ManifestError(where, "a schema 1 manifest has no 'sequence' field")
        return 0
    sequence = _require(doc, "sequence", int, where)
    if sequence < 0:
        raise ManifestError(where, "manifest field 'sequence' is negative")
    return int(sequence)


def writer_ranks(ranks: tuple[int, ...] | None, world_size: int) -> tuple[int, ...]:
    """The ranks that write a checkpoint: `ranks`, or (None) every rank of the job.

    Example:
        >>> writer_ranks(None, 3), writer_ranks((0,), 3)
        ((0, 1, 2), (0,))
    """
    return tuple(range(world_size)) if ranks is None else ranks


def some_ranks(ranks: Any, world_size: int) -> tuple[int, ...] | None:
    """`ranks` as a manifest or marker records them: sorted, or None when they are every
    rank of the job (so that such a checkpoint's files are as they always were).

    Example:
        >>> some_ranks([1, 0], 2), some_ranks([0], 2)
        (None, (0,))
    """
    if ranks is None:
        return None
    ordered = tuple(sorted(ranks))
    return None if ordered == tuple(range(world_size)) else ordered


def _parse_ranks(doc: dict[str, Any], world_size: int, where: str) -> tuple[int, ...] | None:
    """The optional `ranks` field of a manifest or marker: distinct ranks below
    `world_size`, at least one; absent (an older file, or every rank) is None."""
    value = doc.get("ranks")
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(r, int) and not isinstance(r, bool) for r in value)
        or len(set(value)) != len(value)
        or not all(0 <= r < world_size for r in value)
    ):
        raise ManifestError(where, f"field 'ranks' is not a list of ranks below {world_size}")
    return tuple(sorted(value))


@dataclass(frozen=True, slots=True)
class ItemReuse:
    """What the persist of one item file took from its previous version on the same tier
    instead of writing it (protocol/reuse.py): recorded in the rank marker there, shown
    by `nebula inspect`. `source`: the tag of that version; None when nothing was taken.

    Example:
        >>> ItemReuse("model", 90, "global_step1").to_json()
        {'file': 'model', 'bytes': 90, 'from': 'global_step1'}
    """

    file: str
    bytes_reused: int
    source: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes_reused, "from": self.source}


def _parse_reused(value: Any, items: tuple[ItemEntry, ...], where: str) -> tuple[ItemReuse, ...]:
    """A rank marker's optional `reused` field: one entry per item file of the marker at
    most, each with a count of bytes (0 or more) and the tag they came from (or null)."""
    if value is None:
        return ()
    files = {item.file for item in items}
    bad = ManifestError(where, "rank marker field 'reused' is malformed")
    if not isinstance(value, list):
        raise bad
    out: list[ItemReuse] = []
    for entry in value:
        if not isinstance(entry, dict) or set(entry) != {"file", "bytes", "from"}:
            raise bad
        file, count, source = entry["file"], entry["bytes"], entry["from"]
        if file not in files or any(r.file == file for r in out):
            raise bad
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise bad
        if source is not None:
            if not isinstance(source, str):
                raise bad
            try:
                validate_name("tag", source)
            except ValueError as exc:
                raise bad from exc
        out.append(ItemReuse(file, count, source))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RankMarker:
    """`.rank-<r>.json`: one rank's part of a tag is written (the commit protocol: markers.py)."""

    tag: str
    rank: int
    world_size: int
    created_at: str
    items: tuple[ItemEntry, ...]
    labels: tuple[str, ...] = ()
    # The ranks that write this checkpoint when not all of them do (see Manifest.ranks).
    ranks: tuple[int, ...] | None = None
    # Which run of the job (and which restart of it) wrote this part: a checkpoint is
    # committed only from parts of one generation. None: written without one (older).
    generation: str | None = None
    # What the persist that wrote this part to this tier took from earlier versions of its
    # items (only where a persist recorded it: the persistent tier).
    reused: tuple[ItemReuse, ...] = ()

    @property
    def writers(self) -> tuple[int, ...]:
        """The ranks whose parts make this checkpoint."""
        return writer_ranks(self.ranks, self.world_size)

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "schema_version": MARKER_SCHEMA_VERSION,
            "tag": self.tag,
            "rank": self.rank,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "items": [item.to_json() for item in self.items],
            "labels": list(self.labels),
        }
        if self.ranks is not None:
            doc["ranks"] = list(self.ranks)
        if self.generation is not None:
            doc["generation"] = self.generation
        if self.reused:
            doc["reused"] = [entry.to_json() for entry in self.reused]
        return (json.dumps(doc, sort_keys=True) + "\n").encode()


def _json_object(data: bytes, where: str, what: str) -> dict[str, Any]:
    """`data` parsed as one JSON object, bounded in size and nesting (jsonbounds.py);
    `ManifestError` saying what `what` (a manifest, a rank marker) is instead."""
    try:
        doc = load_json(data, max_bytes=MAX_MANIFEST_BYTES)
    except JsonBoundsError as exc:
        raise ManifestError(where, f"{what} is {exc}") from exc
    if not isinstance(doc, dict):
        raise ManifestError(where, f"{what} is not a JSON object")
    return doc


def parse_marker(data: bytes, where: str) -> RankMarker:
    """Parse a rank marker with the same checks as a manifest's items."""
    doc = _json_object(data, where, "rank marker")
    _check_schema(doc, where)
    items = tuple(_parse_item(item, where) for item in _require(doc, "items", list, where))
    labels = doc.get("labels", [])
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise ManifestError(where, "rank marker field 'labels' has the wrong type")
    world_size = _require(doc, "world_size", int, where)
    generation = doc.get("generation")
    if generation is not None and not isinstance(generation, str):
        raise ManifestError(where, "rank marker field 'generation' has the wrong type")
    return RankMarker(
        tag=_require(doc, "tag", str, where),
        rank=_require(doc, "rank", int, where),
        world_size=world_size,
        created_at=_require(doc, "created_at", str, where),
        items=items,
        labels=tuple(labels),
        ranks=_parse_ranks(doc, max(world_size, 1), where),
        generation=generation,
        reused=_parse_reused(doc.get("reused"), items, where),
    )


def parse_utc(value: object) -> datetime | None:
    """An ISO-8601 time as written by `utc_now` (naive: UTC), or None if `value` is not one.

    Example:
        >>> parse_utc("2026-11-29T09:24:01.123456Z").year, parse_utc("x"), parse_utc(None)
        (2026, None, None)
    """
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def utc_now() -> str:
    """The current time as ISO-8601 UTC with microseconds, e.g. 2026-11-29T09:24:01.123456Z."""
    # isoformat is strftime's format here ("+00:00" for "Z"), at a fraction of its cost.
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")[:-6] + "Z"
