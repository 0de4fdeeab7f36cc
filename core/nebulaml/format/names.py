"""Tags and item names: what is allowed, and how tags are ordered; and the reserved names
of nebula's own files, each spelled here and nowhere else.

A tag names a folder and an item names a file inside it, so both are checked before any
I/O: nothing a caller passes may climb out of the root or name one of our own files. Our
own files (the manifest, markers, leases, a root's identity, a memory tier's hold and
pool, appended segments) are named here, the lowest layer, so that every layer that needs
one imports its spelling; what each means is told by the module that writes it.

Not for: paths or URLs of roots (storage/store.py's `Store` owns those).
"""

from __future__ import annotations

import functools
import re
import unicodedata

from nebulaml.errors import InvalidNameError

MAX_NAME_BYTES = 255
# Steps are ASCII digits only: `\d` would take Arabic-Indic or full-width digits for a step.
_STEP_RE = re.compile(r"global_step([0-9]+)")
# Lightning's `{step}` in a file name: `epoch=1-step=200`.
_LIGHTNING_STEP_RE = re.compile(r"(?<![A-Za-z0-9])step=([0-9]+)")
# Characters a name must not hold: controls (Cc: C0, DEL, C1 such as U+0085), format
# characters (Cf: bidi overrides and isolates such as U+202E and U+2066, zero-width ones
# such as U+200B, the BOM U+FEFF) and line and paragraph separators (Zl, Zp). They make a
# name display as another name, or break the line it is shown on.
_INVISIBLE = frozenset({"Cf", "Zl", "Zp"})
# "Newest" order: (step or -1, sequence, committed_at, tag); see `order_key`.
OrderKey = tuple[int, int, str, str]

# Reserved names: all but the manifest's start with "." (no tag or item may: `validate_name`),
# and no item may take the manifest's.
MANIFEST_NAME = "manifest.json"  # in a tag folder: its commit (format/manifest.py)
RANK_PREFIX = ".rank-"  # `marker_name`: one rank's part is written (format/manifest.py)
WRITER_PREFIX = ".writer-"  # `writer_marker_name`: who writes a part (protocol/markers.py)
LEASE_PREFIX = ".lease-"  # a reader's lease or a deleter's claim (protocol/leases.py)
ROOT_ID_FILE = ".nebula-root-id.json"  # in a persistent root: its identity (tier_identity.py)
ROOT_INFO_FILE = ".nebula-root.json"  # in a memory tier: which root it belongs to (ditto)
SEQUENCE_FILE = ".nebula-sequence.json"  # in every tier: the highest commit sequence
# reserved there (protocol/sequence.py: `reserve_sequence`), so a commit never reads every
# manifest
INDEX_DIR = ".nebula-index"  # in every tier: an empty file `<sequence>-<tag>` per commit,
# written before its manifest, so that the newest is found without reading every manifest
# (protocol/commit_index.py)
HOLD_FILE = ".nebula-hold"  # in a memory tier: share-locked by every live session
# (protocol/tier_lifetime.py: `TierHold`)
RANK_LOCK_PREFIX = ".nebula-rank-"  # in a memory tier: `<rank>.lock`, locked by the live
# process of that rank on this node (protocol/rank_presence.py: `RankPresence`)
REMOVALS_PREFIX = ".nebula-removals-"  # in a memory tier: `<rank>.json`, the checkpoints a
# framework removed that are not yet deleted from every tier (protocol/removals.py)
SLOTS_DIR = ".slots"  # in a memory tier: the pool of reused item files (runtime/slots.py)
WRITERS_DIR = ".writers"  # in a memory tier: the writer markers saves link (runtime/slots.py)
JOB_PREFIX = ".nebula-job-"  # the job that writes a root: `.nebula-job-<n>.json` in a
# persistent root, `.nebula-job-<id digest>.lock` in a memory tier (protocol/holds.py)
JOB_CLAIM_FILE = ".nebula-claim"  # in a memory tier: locked while a job claims it
WRITING_PREFIX = ".nebula-writing-"  # in the memory-tier base folder: `<digest>.lock`
# by the node's one writer of a tag at a destination (protocol/cowriters.py)
REPLICAS_DIR = ".replicas"  # in a memory tier: the parts of another node's ranks kept for
# them, `rank-<r>/<tag>/` (protocol/replicas.py)
REPLICA_DONE = ".replica.json"  # in a replica's tag folder: written last, create-only: the
# replica is whole and verified (protocol/replicas.py)


def marker_name(rank: int) -> str:
    """The rank marker of `rank` in a tag folder: that rank's part is written.

    Example:
        >>> marker_name(3), writer_marker_name(3)
        ('.rank-3.json', '.writer-3.json')
    """
    return f"{RANK_PREFIX}{rank}.json"


def writer_marker_name(rank: int) -> str:
    """The writer marker of `rank` in a tag folder: who is writing that rank's part (host,
    pid), until it commits."""
    return f"{WRITER_PREFIX}{rank}.json"


def segments_folder(name: str) -> str:
    """Where appends to file `name` go on object stores: a hidden folder beside it, one
    object per append (hidden: never taken for a checkpoint tag).

    Example:
        >>> segments_folder("checkpointHistories.csv")
        '.checkpointHistories.csv.d'
    """
    return f".{name}.d"


def validate_name(kind: str, name: object) -> str:
    """Return `name` if it is a safe tag or item name, else raise `InvalidNameError`.

    Refused: non-strings, empty names, names over 255 UTF-8 bytes, path separators,
    `..`, control characters, invisible, direction-changing and line-separating
    characters (Unicode categories Cc, Cf, Zl and Zp, the BOM among them), and names
    starting with `.` (reserved for nebula's markers).

    Example:
        >>> validate_name("tag", "global_step500")
        'global_step500'
    """
    if not isinstance(name, str):
        raise InvalidNameError(kind, name, f"must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidNameError(kind, name, "must not be empty")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidNameError(kind, name[:40] + "...", f"longer than {MAX_NAME_BYTES} bytes")
    if "/" in name or "\\" in name:
        raise InvalidNameError(kind, name, "must not contain a path separator")
    if ".." in name:
        raise InvalidNameError(kind, name, "must not contain '..'")
    if name.isascii():
        # ASCII: printable is 32-126, so this refuses exactly the control characters.
        if not name.isprintable():
            raise InvalidNameError(kind, name, "must not contain control characters")
    else:
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise InvalidNameError(kind, name, "must not contain control characters")
        for c in name:
            category = unicodedata.category(c)
            if category == "Cc":
                raise InvalidNameError(kind, name, "must not contain control characters")
            if category == "Cs":  # a byte of a file name that is not UTF-8
                raise InvalidNameError(kind, name, "must be valid UTF-8")
            if category in _INVISIBLE:
                raise InvalidNameError(
                    kind,
                    name,
                    f"must not contain U+{ord(c):04X} (an invisible, direction-changing or "
                    "line-separating character: the name would show as another name)",
                )
    if name.startswith("."):
        raise InvalidNameError(kind, name, "must not start with '.' (reserved for nebula)")
    if name.strip() != name:
        raise InvalidNameError(kind, name, "must not start or end with white space")
    if kind == "item" and name == MANIFEST_NAME:
        raise InvalidNameError(kind, name, "is reserved for the checkpoint's manifest")
    return name


_NUMBER_RE = re.compile(r"[0-9]+")


def name_number(text: str) -> int | None:
    """The number `text` spells in ASCII digits, or None: the one rule for every number in
    a reserved file name (a generation, a pid, a record key). `str.isdigit` accepts "²",
    which `int` refuses; a name someone else wrote is ignored, never an exception.

    Example:
        >>> name_number("00000012"), name_number("²"), name_number("-1"), name_number("")
        (12, None, None, None)
    """
    return int(text) if _NUMBER_RE.fullmatch(text) else None


@functools.lru_cache(maxsize=1 << 16)
def step_of(tag: str) -> int | None:
    """The training step a tag names, in ASCII digits alone: the number after
    `global_step` (DeepSpeed's and nebula's tags), else after a Lightning `step=`; else
    None. A number that goes on in a digit of another script (`global_step12²`,
    `global_step1٢`) names no step: its ASCII head is not the number the tag spells.

    Example:
        >>> step_of("global_step1000"), step_of("epoch=1-step=200"), step_of("best")
        (1000, 200, None)
        >>> step_of("global_step12²") is None
        True
    """
    match = _STEP_RE.search(tag) or _LIGHTNING_STEP_RE.search(tag)
    if match is None:
        return None
    after = tag[match.end(1) : match.end(1) + 1]
    return None if after.isnumeric() else int(match.group(1))


def order_key(tag: str, committed_at: str = "", sequence: int = 0) -> OrderKey:
    """Sort key for "newest", the one order of checkpoints everywhere (listings, latest,
    retention, prune, persist, recovery): the step the tag names (`step_of`; tags without
    one sort first), then the checkpoint's commit `sequence` on its root (manifest.py's
    `Manifest`: clock-free, so a clock stepped back or ahead reorders nothing), then the
    ISO-8601 commit time (a tie-break only), then the tag itself so that the order is total.

    A key made from the tag alone (`order_key(tag)`) is at most the key of any
    checkpoint of that tag: what is "newer than the newest" is known from tags alone only
    by the step.

    Example:
        >>> sorted(["global_step10", "global_step9"], key=order_key)
        ['global_step9', 'global_step10']
        >>> order_key("best", "2026-01-01T00:00:00Z", 7) > order_key("best2", "2030-01-01", 6)
        True
    """
    step = step_of(tag)
    return (step if step is not None else -1, sequence, committed_at, tag)
