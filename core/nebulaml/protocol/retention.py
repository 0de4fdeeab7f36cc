"""Which committed checkpoints may be deleted: pure functions, no I/O.

"Newest" is names.order_key's order: the step a tag names, then the commit sequence, the
commit time last. A clock stepped back or ahead between saves changes no decision.

Not for: deleting (catalog.delete_checkpoint does it, manifest first).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from nebulaml.format.manifest import Manifest
from nebulaml.format.names import OrderKey, order_key


@dataclass(frozen=True, slots=True)
class Version:
    """What retention needs to know of one committed checkpoint: its tag, commit time,
    labels and commit sequence (format/manifest.py: 0 for a schema 1 manifest)."""

    tag: str
    committed_at: str
    labels: tuple[str, ...] = ()
    sequence: int = 0

    @classmethod
    def of(cls, manifest: Manifest) -> Version:
        """The version of the committed checkpoint `manifest` describes."""
        return cls(manifest.tag, manifest.committed_at, manifest.labels, manifest.sequence)

    @property
    def sort_key(self) -> OrderKey:
        return order_key(self.tag, self.committed_at, self.sequence)


def plan_retention(
    versions: Sequence[Version], keep: int, protected: Collection[str] = ()
) -> list[str]:
    """Tags to delete so that `keep` newest unlabelled versions remain.

    Never returned: the newest version, labelled versions, and tags in `protected`
    (being written or read). Labelled and protected versions do not count towards `keep`.
    Of the others, every version returned is older than every version kept.

    Example:
        >>> vs = [Version(f"global_step{i}", "") for i in range(4)]
        >>> plan_retention(vs, keep=2)
        ['global_step0', 'global_step1']
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    if sum(1 for v in versions if not v.labels and v.tag not in protected) < keep:
        # Fewer than `keep` that count, the newest aside: nothing goes (a root kept whole,
        # thousands of checkpoints, need not be sorted on every persist).
        return []
    ordered = sorted(versions, key=lambda v: v.sort_key, reverse=True)
    if not ordered:
        return []
    newest = ordered[0].tag
    kept = 0
    delete: list[str] = []
    for version in ordered:
        if version.tag == newest or version.labels or version.tag in protected:
            if version.tag == newest:
                kept += 1
            continue
        if kept < keep:
            kept += 1
            continue
        delete.append(version.tag)
    return delete[::-1]  # oldest first
