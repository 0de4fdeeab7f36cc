"""Which checkpoint the ranks recover after a restart, from what each rank holds (issue
#44): pure, so that every rank computes the same answer from the same offers.

    Offer            what one rank can give: its own parts, the replicas its node keeps,
                     and (the lowest rank) the persistent tier's newest checkpoint
    agree            the checkpoint and the parts to send back (`Plan`), from every
                     rank's offer
    why_incomplete   why a newer checkpoint cannot be completed: the warning's words

**The rule.** The newest checkpoint (format/names.py's `order_key` on its tag and the
earliest `created_at` of its parts, the persistent copy's when it is there) for which
every rank that writes it (its markers' `writers`, one generation) has its part in its
own memory tier, or a replica of it on a node that has not failed it and that rank can
receive it, or which the persistent tier holds whole. On a tie the persistent tier's
copy wins (nothing moves), then the higher generation; a part is sent by the lowest rank
that holds it. A tag the persistent tier holds as its newest is taken from there:
versions of one tag (a tag saved again, Lightning's `last`) are not told apart by their
parts, so the persisted one is what resumes. A replica refused is passed as `excluded`:
the ranks agree anew without it.

May import: `nebulaml.format` and protocol/part_restore.py (`HeldPart`). Not for: the
collective that gathers the offers and moves the parts (runtime/peer_recovery.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from nebulaml.format.names import OrderKey, order_key
from nebulaml.protocol.part_restore import Damaged, HeldPart

PARTS = "parts"  # the agreed checkpoint comes from the nodes' parts and replicas
PERSISTENT = "persistent"  # from the persistent tier, whole
NONE = "none"  # no checkpoint is complete anywhere


@dataclass(frozen=True, slots=True)
class Offer:
    """What rank `rank` (of node `node`) can give: the parts it holds (its own, and the
    replicas its node keeps), the persistent tier's newest checkpoint as (tag,
    created_at) when it looked, whether its memory tier can take a part (`can_receive`),
    and the replicas there whose marker is not what their record says (`damaged`: not
    offered, but said when they were needed)."""

    rank: int
    node: int
    parts: tuple[HeldPart, ...] = ()
    persistent: tuple[str, str] | None = None
    can_receive: bool = True
    damaged: tuple[Damaged, ...] = ()


class Transfer(NamedTuple):
    """Rank `rank`'s part of `tag` sent back to it by `holder`, which keeps its replica."""

    tag: str
    rank: int
    holder: int


@dataclass(frozen=True, slots=True)
class Incomplete:
    """A checkpoint newer than the one agreed that no node can complete: the ranks whose
    part of it is nowhere (or only in replicas refused)."""

    tag: str
    missing: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """What every rank computes alike (`agree`): the checkpoint `tag` and its `source`
    (`PARTS`, `PERSISTENT`, `NONE`), the ranks that write it (from the parts), the parts
    to send back, and the newer checkpoints that cannot be completed, newest first."""

    tag: str | None = None
    source: str = NONE
    writers: tuple[int, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    newer: tuple[Incomplete, ...] = ()


@dataclass(slots=True)
class _Parts:
    """Every rank's offers of one (tag, generation)."""

    writers: set[tuple[int, ...]] = field(default_factory=set)
    created: list[str] = field(default_factory=list)
    own: set[int] = field(default_factory=set)
    holders: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Candidate:
    key: OrderKey
    persistent: bool
    generation: str
    tag: str
    writers: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    parts: _Parts | None = None

    @property
    def rank_key(self) -> tuple[OrderKey, bool, str]:
        return (self.key, self.persistent, self.generation)


def agree(offers: Sequence[Offer], excluded: Collection[tuple[str, int, int]] = ()) -> Plan:
    """The checkpoint the ranks recover, from every rank's offer (the module's docstring
    says how it is chosen); `excluded`: replicas refused, as (tag, rank whose part, node
    that keeps it). Pure: every rank computes the same from the same offers.

    Example:
        >>> def part(tag, rank, replica=False):
        ...     return HeldPart(tag, rank, "g1", (0, 1), f"2026-01-01T00:00:0{rank}Z", replica)
        >>> node0 = Offer(0, 0, (part("global_step3", 0), part("global_step3", 1, True)),
        ...               persistent=("global_step1", "2025-12-31T00:00:00Z"))
        >>> node1 = Offer(1, 1)  # a fresh node: its memory tier was lost
        >>> plan = agree([node0, node1])
        >>> plan.tag, plan.source, plan.transfers
        ('global_step3', 'parts', (Transfer(tag='global_step3', rank=1, holder=0),))
        >>> plan = agree([node0, node1], excluded={("global_step3", 1, 0)})  # refused
        >>> plan.tag, plan.source, plan.newer
        ('global_step1', 'persistent', (Incomplete(tag='global_step3', missing=(1,)),))
    """
    bad = set(excluded)
    by_rank = {offer.rank: offer for offer in offers}
    groups: dict[tuple[str, str | None], _Parts] = {}
    for offer in sorted(offers, key=lambda o: o.rank):
        for part in offer.parts:
            if part.replica == (part.rank == offer.rank):
                continue  # a rank's own part is its own; a replica is another rank's
            group = groups.setdefault((part.tag, part.generation), _Parts())
            group.writers.add(tuple(part.writers))
            group.created.append(part.created_at)
            if not part.replica:
                group.own.add(part.rank)
            elif (part.tag, part.rank, offer.node) not in bad:
                group.holders.setdefault(part.rank, []).append(offer.rank)
    newest_persistent = max(
        (o.persistent for o in offers if o.persistent is not None),
        key=lambda p: order_key(p[0], p[1]),
        default=None,
    )
    candidates: list[_Candidate] = []
    if newest_persistent is not None:
        tag, created = newest_persistent
        candidates.append(_Candidate(order_key(tag, created), True, "", tag))
    for (tag, generation), group in groups.items():
        if len(group.writers) != 1 or (newest_persistent and tag == newest_persistent[0]):
            continue  # parts that disagree on the job; a tag the persistent tier holds
        (writers,) = group.writers

        def available(w: int, group: _Parts = group) -> bool:
            receiver = by_rank.get(w)
            can = receiver is not None and receiver.can_receive
            return w in group.own or (can and bool(group.holders.get(w)))

        missing = tuple(w for w in writers if not available(w))
        key = order_key(tag, min(group.created))
        candidates.append(_Candidate(key, False, generation or "", tag, writers, missing, group))
    complete = [c for c in candidates if not c.missing]
    if not complete:
        newer = sorted((c for c in candidates if c.missing), key=lambda c: c.rank_key)
        return Plan(newer=tuple(Incomplete(c.tag, c.missing) for c in reversed(newer)))
    chosen = max(complete, key=lambda c: c.rank_key)
    newer = sorted(
        (c for c in candidates if c.missing and c.rank_key > chosen.rank_key),
        key=lambda c: c.rank_key,
        reverse=True,
    )
    incomplete = tuple(Incomplete(c.tag, c.missing) for c in newer)
    if chosen.persistent:
        return Plan(chosen.tag, PERSISTENT, newer=incomplete)
    assert chosen.parts is not None
    transfers = tuple(
        Transfer(chosen.tag, w, min(chosen.parts.holders[w]))
        for w in sorted(chosen.writers)
        if w not in chosen.parts.own
    )
    return Plan(chosen.tag, PARTS, tuple(sorted(chosen.writers)), transfers, incomplete)


def why_incomplete(newest: Incomplete, newer: Sequence[Incomplete], offers: Sequence[Offer]) -> str:
    """Why `newest` (of `newer`, the checkpoints newer than the one agreed that no node can
    complete) cannot be completed, from every rank's offer (pure). For each rank whose part
    is missing: no node keeps a replica of its part at all (its node and the partner
    keeping its replicas both lost), or the newest one a node keeps is of another tag; and
    when that tag cannot be completed either, which ranks no longer hold their own part of
    it (their node is there: it offers parts of other tags).

    Example:
        >>> def part(tag, rank, replica=False):
        ...     return HeldPart(tag, rank, "g1", (0, 1), "2026-01-01T00:00:00Z", replica)
        >>> node0 = Offer(0, 0, (part("global_step3", 0), part("global_step2", 1, True)))
        >>> newer = [Incomplete("global_step3", (1,)), Incomplete("global_step2", (0,))]
        >>> for said in why_incomplete(newer[0], newer, [node0, Offer(1, 1)]).split("; "):
        ...     print(said)
        rank 1's node was lost, and node 0 keeps its replica of 'global_step2', not of it
        'global_step2' cannot be completed either: rank(s) 0 no longer hold their own part of it
        >>> "were both lost" in why_incomplete(newer[0], newer, [Offer(0, 0), Offer(1, 1)])
        True
    """
    alive = {o.rank for o in offers if any(not p.replica for p in o.parts)}
    held: dict[int, list[tuple[OrderKey, str, int]]] = {}
    for offer in offers:
        for p in offer.parts:
            if p.replica and p.rank != offer.rank:
                held.setdefault(p.rank, []).append(
                    (order_key(p.tag, p.created_at), p.tag, offer.node)
                )
    replicas = {rank: max(found) for rank, found in held.items()}  # each rank's newest
    said: list[str] = []
    nowhere = [w for w in newest.missing if w not in replicas]
    if nowhere:
        said.append(
            f"the part of rank(s) {', '.join(map(str, nowhere))} is on no node (its node and "
            "the partner keeping its replica were both lost)"
        )
    behind: list[str] = []
    for w in newest.missing:
        if w not in replicas:
            continue
        _key, tag, node = replicas[w]
        what = f"rank {w} holds no part of it" if w in alive else f"rank {w}'s node was lost"
        said.append(f"{what}, and node {node} keeps its replica of {tag!r}, not of it")
        if tag != newest.tag and tag not in behind:
            behind.append(tag)
    for tag in behind:
        incomplete = next((n for n in newer if n.tag == tag), None)
        if incomplete is None:
            continue
        own = [w for w in incomplete.missing if w in alive]
        gone = [w for w in incomplete.missing if w not in alive]
        why = []
        if own:
            why.append(f"rank(s) {', '.join(map(str, own))} no longer hold their own part of it")
        if gone:
            why.append(f"the part of rank(s) {', '.join(map(str, gone))} is on no node")
        said.append(f"{tag!r} cannot be completed either: {' and '.join(why)}")
    return "; ".join(said)
