"""The names and places of a tier's commit index (commit_index.py): what each file is
called and in which bucket it lies. Nothing here touches a store.

    entry_name / parse_entry      `<step + 1>.<sequence>-<tag>`: a commit's entry
    begun_name / parse_begun      `<step + 1>+<tag>`: a tag folder a writer begins
    entry_path / begun_path       where this version writes them: the bucket of the step
    bucket_of / in_bucket         the bucket of a name, and whether a name lies in its own

Both numbers are 20 digits, so names sort as their checkpoints do. A tag too long for a
name gets `#<sha256>` in its place, and the file holds the tag.

Buckets. Entries and begun records lie in `.nebula-index/<L1>/<L2>/`, where, of the 20
digits of `step + 1`, L1 is the first 14 (steps by the million) and L2 the next 3 (by the
thousand): a bucket's names all begin with its L1 and L2, so walking the buckets from the
highest down and each one's names from the highest down yields every name in order. A
tier's newest is then found from a listing of the index's folder, one of the highest L1
and one of the highest L2, whatever the number of checkpoints: at most 1,000 names each
for steps below 10^9, where a flat index had one name per commit. An older nebula wrote
its entries flat in `.nebula-index/` itself: they are read there too (commit_index.py).

May import: `nebulaml.format` only.
"""

from __future__ import annotations

import hashlib

from nebulaml.format.names import INDEX_DIR, MAX_NAME_BYTES, order_key

DIGITS = 20
PREFIX = 2 * DIGITS + 1  # "<step + 1>.<sequence>"
HASHED = "#"  # a tag too long for a name: `#<sha256>`, the file holds the tag
BEGUN = "+"  # `<step + 1>+<tag>`: a writer began the tag's folder
_L1, _L2 = 14, 17  # the bucket's two levels: the first 14 digits, then 3 more

Key = tuple[int, int]  # (step, sequence): order_key's first two


def _tagged(prefix: str, sep: str, tag: str) -> str:
    name = f"{prefix}{sep}{tag}"
    if len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES:
        return name
    digest = hashlib.sha256(tag.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{prefix}{sep}{HASHED}{digest}"


def _steps(tag: str) -> str:
    return f"{order_key(tag)[0] + 1:0{DIGITS}d}"


def entry_name(tag: str, sequence: int) -> str:
    """The index entry of `tag` committed with `sequence`.

    Example:
        >>> entry_name("global_step7", 12)
        '00000000000000000008.00000000000000000012-global_step7'
        >>> entry_name("best", 3)[:PREFIX]
        '00000000000000000000.00000000000000000003'
    """
    return _tagged(f"{_steps(tag)}.{sequence:0{DIGITS}d}", "-", tag)


def parse_entry(name: str) -> tuple[Key, str] | None:
    """((step, sequence), tag) of an entry's name (the tag `#<sha256>` for a hashed
    one), or None for a name that is not an entry. The tag is not checked: an entry
    counts only for a committed tag of that name.

    Example:
        >>> parse_entry(entry_name("global_step7", 12)), parse_entry("x-y")
        (((7, 12), 'global_step7'), None)
    """
    head, tag = name[:PREFIX], name[PREFIX + 1 :]
    if name[PREFIX : PREFIX + 1] != "-" or not tag or head[DIGITS] != ".":
        return None
    step, sequence = head[:DIGITS], head[DIGITS + 1 :]
    if not (step.isascii() and step.isdigit() and sequence.isascii() and sequence.isdigit()):
        return None
    return (int(step) - 1, int(sequence)), tag


def begun_name(tag: str) -> str:
    """The record that a writer begins `tag`'s folder (commit.begin_tag), written before
    the folder: a restart finds the folders at the top by these, without listing the
    root.

    Example:
        >>> begun_name("global_step7")
        '00000000000000000008+global_step7'
    """
    return _tagged(_steps(tag), BEGUN, tag)


def parse_begun(name: str) -> tuple[int, str] | None:
    """(step, tag) of a begun record's name (the tag `#<sha256>` for a hashed one), or
    None for a name that is not one.

    Example:
        >>> parse_begun(begun_name("global_step7")), parse_begun(entry_name("a", 1))
        ((7, 'global_step7'), None)
    """
    step, tag = name[:DIGITS], name[DIGITS + 1 :]
    if name[DIGITS : DIGITS + 1] != BEGUN or not tag or not (step.isascii() and step.isdigit()):
        return None
    return int(step) - 1, tag


def bucket_of(name: str) -> tuple[str, str]:
    """The bucket (L1, L2) where this version writes the entry or begun record `name`.

    Example:
        >>> bucket_of(entry_name("global_step1234567", 1))
        ('00000000000001', '234')
    """
    return name[:_L1], name[_L1:_L2]


def entry_path(tag: str, sequence: int) -> tuple[str, str, str, str]:
    """Where this version writes `tag`'s entry of `sequence`: in its step's bucket.

    Example:
        >>> entry_path("global_step7", 12)[:3]
        ('.nebula-index', '00000000000000', '000')
    """
    name = entry_name(tag, sequence)
    return (INDEX_DIR, *bucket_of(name), name)


def begun_path(tag: str) -> tuple[str, str, str, str]:
    """Where `tag`'s begun record lies: in its step's bucket, beside its entries."""
    name = begun_name(tag)
    return (INDEX_DIR, *bucket_of(name), name)


def is_bucket(name: str, level: int) -> bool:
    """Whether `name` is a bucket's folder of `level` (1: 14 digits, 2: 3 digits).

    Example:
        >>> is_bucket("00000000000000", 1), is_bucket("000", 2), is_bucket("..", 2)
        (True, True, False)
    """
    size = _L1 if level == 1 else _L2 - _L1
    return len(name) == size and name.isascii() and name.isdigit()


def in_bucket(name: str, bucket: tuple[str, str]) -> bool:
    """Whether `name` lies in its own bucket (one elsewhere is out of order: not read).

    Example:
        >>> in_bucket(entry_name("global_step7", 1), ("00000000000000", "000"))
        True
    """
    return name[:_L2] == bucket[0] + bucket[1]


def tag_key(tag: str) -> str:
    """What an entry or begun record of `tag` names in place of the tag: the tag, or
    `#<sha256>` for one too long for a name.

    Example:
        >>> tag_key("global_step7")
        'global_step7'
    """
    return entry_name(tag, 0)[PREFIX + 1 :]
