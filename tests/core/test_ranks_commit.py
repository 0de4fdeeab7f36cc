"""The commit protocol for checkpoints that some ranks write (`ranks`), parts of one
generation only, and item names that two ranks claim (the real multi-process jobs are in
tests/dist/test_writers.py and test_generations.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.errors import PartSupersededError
from nebulaml.format.manifest import RankMarker, parse_manifest, parse_marker
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.commit import (
    await_commit,
    begin_tag,
    claim_item,
    commit_rank,
    write_item,
)
from nebulaml.protocol.markers import own_parts
from nebulaml.protocol.recovery import discard_stale_parts
from nebulaml.protocol.tiers import TierSet, open_tiers
from nebulaml.protocol.transfer import copy_checkpoint, copy_part
from nebulaml.runtime.persister import Persister
from nebulaml.runtime.ranks import RankInfo
from nebulaml.storage.store import Store

TAG = "global_step1"


def _part(store: Store, rank: int, names: list[str], **commit: object) -> object:
    begin_tag(store, TAG, rank=rank, overwrite=False, world_size=2)
    items = [write_item(store, TAG, n, {"w": torch.full((4,), rank)}, rank=rank) for n in names]
    return commit_rank(store, TAG, rank=rank, world_size=2, items=items, created_at="t", **commit)


def test_a_checkpoint_of_rank_0_alone_commits_without_the_others(tmp_path: Path) -> None:
    """Bug caught: a manifest waiting for every rank of the job, or one that forgets which
    ranks wrote it (every reader then believes rank 1's part is missing)."""
    store = Store(tmp_path / "root")
    manifest = _part(store, 0, ["model"], ranks=[0])
    assert manifest is not None and manifest.world_size == 2 and manifest.ranks == (0,)
    doc = json.loads(store.read_bytes(TAG, "manifest.json"))
    assert doc["ranks"] == [0] and doc["world_size"] == 2
    assert parse_manifest(store.read_bytes(TAG, "manifest.json"), "m").writers == (0,)
    # A copy keeps it (the persister of one process, nebula copy).
    info = read_committed(store, TAG)
    assert info is not None
    copied = copy_checkpoint(info, Store(tmp_path / "other")).manifest
    assert copied.ranks == (0,) and copied.world_size == 2


def test_every_rank_checkpoints_are_written_as_before(tmp_path: Path) -> None:
    """All ranks (the default, or named in full): no `ranks` field, as older manifests."""
    store = Store(tmp_path / "root")
    assert _part(store, 0, ["a"], ranks=[1, 0]) is None
    manifest = _part(store, 1, ["b"], ranks=[0, 1])
    assert manifest is not None and manifest.ranks is None and manifest.writers == (0, 1)
    assert "ranks" not in json.loads(store.read_bytes(TAG, "manifest.json"))


def test_parts_of_two_generations_are_never_committed_together(tmp_path: Path) -> None:
    """Rank 0's part from before a restart, rank 1's from after. Bug caught: a torn
    checkpoint committed from both."""
    store = Store(tmp_path / "root")
    assert _part(store, 0, ["a"], generation="run.0") is None
    assert _part(store, 1, ["b"], generation="run.1") is None  # not with run.0's part
    assert read_committed(store, TAG) is None
    with pytest.raises(nm.RankTimeoutError, match="another run or restart") as caught:
        await_commit(store, TAG, world_size=2, generation="run.1", timeout_s=0.05)
    assert caught.value.stale == [0]
    # Rank 0's part of the new run replaces its old one: the tag commits, one generation.
    manifest = _part(store, 0, ["a"], generation="run.1")
    assert manifest is not None
    markers = [
        parse_marker(store.read_bytes(TAG, f".rank-{r}.json"), "m").generation for r in (0, 1)
    ]
    assert markers == ["run.1", "run.1"]


@pytest.mark.parametrize(
    ("ours", "theirs", "there_first", "gives_up"),
    [
        pytest.param("run.0", "run.0/2", False, True, id="their second save, our first"),
        pytest.param("run.0/2", "run.0/3", False, True, id="their third, our second"),
        pytest.param("run.0/2", "run.0", False, False, id="theirs older: it comes"),
        pytest.param("run.1", "run.0/2", False, False, id="another run's: stale, waited out"),
        pytest.param(
            "run.0", "run.0/3", True, False, id="there from the start: an earlier session's?"
        ),
    ],
)
def test_the_wait_gives_up_at_once_a_save_another_rank_saved_again(
    tmp_path: Path, ours: str, theirs: str, there_first: bool, gives_up: bool
) -> None:
    """While rank 0 waits for rank 1's part of its save, rank 1 persists its part of a
    later save of the tag (it saved the tag again, overwrite=True, meanwhile): its part of
    rank 0's save will never come. Bug caught (tests/dist/test_follower_catches_up.py):
    the leader's persist of the earlier save waited rank_timeout_s for it, and so did its
    own save of the tag again. A part of a later save there before the wait began may be
    an earlier session's (which counted its saves of the tag from 1 again): waited out."""
    store = Store(tmp_path / "root")
    if there_first:
        assert _part(store, 1, ["b"], generation=theirs) is None
    assert _part(store, 0, ["a"], generation=ours) is None
    late = threading.Timer(0.1, _part, (store, 1, ["b"]), {"generation": theirs})
    if not there_first:
        late.start()
    started = time.monotonic()
    error = PartSupersededError if gives_up else nm.RankTimeoutError
    try:
        with pytest.raises(error) as caught:
            await_commit(store, TAG, world_size=2, generation=ours, timeout_s=1.5)
    finally:
        if not there_first:
            late.join()
    assert caught.value.stale == [1]
    assert (time.monotonic() - started < 1.2) is gives_up
    assert read_committed(store, TAG) is None  # never from parts of two saves


def test_an_item_name_twice_is_never_committed(tmp_path: Path) -> None:
    """Bug caught: a manifest listing "model" twice (every reader then ignores it)."""
    store = Store(tmp_path / "root")
    assert _part(store, 0, ["model"]) is None
    begin_tag(store, TAG, rank=1, overwrite=False, world_size=2)
    elsewhere = Store(tmp_path / "elsewhere")  # rank 1's node
    elsewhere.make_dir(TAG)
    item = write_item(elsewhere, TAG, "model", {"w": 1}, rank=1)
    with pytest.raises(nm.ItemCollisionError, match=r"'model' .* by rank 0 and by rank 1"):
        commit_rank(store, TAG, rank=1, world_size=2, items=[item], created_at="t")
    assert read_committed(store, TAG) is None


def test_a_rank_claims_an_item_name_before_writing_it(tmp_path: Path) -> None:
    """Two ranks on one tier: the second to claim "model" is refused before it writes."""
    store = Store(tmp_path / "root")
    begin_tag(store, TAG, rank=0, overwrite=False, world_size=2)
    begin_tag(store, TAG, rank=1, overwrite=False, world_size=2)
    claim_item(store, TAG, "model", rank=0, claimed=[])
    claim_item(store, TAG, "extra", rank=1, claimed=[])
    with pytest.raises(nm.ItemCollisionError) as caught:
        claim_item(store, TAG, "model", rank=1, claimed=["extra"])
    assert caught.value.ranks == (0, 1) and caught.value.name == "model"
    # The refused claim is withdrawn; the earlier one stays.
    writer = json.loads(store.read_bytes(TAG, ".writer-1.json"))
    assert writer["items"] == ["extra"]
    # Rank 0's part, committed and waiting for rank 1's, keeps its claim.
    item = write_item(store, TAG, "model", {"w": 1}, rank=0)
    commit_rank(store, TAG, rank=0, world_size=2, items=[item], created_at="t")
    with pytest.raises(nm.ItemCollisionError):
        claim_item(store, TAG, "model", rank=1, claimed=["extra"])
    # A dead process's claim is no claim.
    dead = json.loads(store.read_bytes(TAG, ".writer-0.json"))
    dead["pid"] = 2**22 + 12345  # above the kernel's pid limit: never alive
    store.publish((TAG, ".writer-0.json"), json.dumps(dead).encode(), create_only=False)
    claim_item(store, TAG, "model", rank=1, claimed=["extra"])


def test_init_discards_only_this_ranks_parts_of_other_generations(tmp_path: Path) -> None:
    store = Store(tmp_path / "mem")
    _part(store, 0, ["a"], generation="run.0")
    _part(store, 1, ["b"], generation="run.0")  # committed: a whole checkpoint, kept
    begin_tag(store, "global_step2", rank=0, overwrite=False, world_size=2)
    item = write_item(store, "global_step2", "a", {"w": 1}, rank=0)
    commit_rank(store, "global_step2", rank=0, world_size=2, items=[item], created_at="t",
                generation="run.0")  # fmt: skip
    store.remove("global_step2", ".writer-0.json")  # its writer is gone
    assert discard_stale_parts(store, 1, "run.1") == []  # rank 1 has no stale part
    assert discard_stale_parts(store, 0, "run.0") == []  # its own generation
    assert discard_stale_parts(store, 0, "run.1") == ["global_step2"]
    assert read_committed(store, TAG) is not None
    assert ".rank-0.json" not in store.list_files("global_step2")


def test_copy_part_and_the_persister_follow_the_lowest_writing_rank(tmp_path: Path) -> None:
    """A checkpoint that rank 1 alone writes: rank 1 decides and commits its persist; rank
    0 never hears of it. Bug caught: rank 1 waiting forever for rank 0's lead."""
    tiers = open_tiers(str(tmp_path / "root"))
    assert tiers.persistent is not None
    begin_tag(tiers.memory, TAG, rank=1, overwrite=False, world_size=2)
    item = write_item(tiers.memory, TAG, "rank1_only", {"w": 1}, rank=1)
    commit_rank(tiers.memory, TAG, rank=1, world_size=2, items=[item], created_at="t",
                ranks=[1])  # fmt: skip
    persister = Persister(
        tiers, interval_s=0, retention=2, ranks=RankInfo(1, 2, 1, 2), rank_timeout_s=5
    )
    try:
        persister.notify_committed(TAG, leader=1)
        assert persister.flush(TAG, timeout_s=30) == TAG
    finally:
        persister.close(timeout_s=10)
    info = read_committed(tiers.persistent, TAG)
    assert info is not None and info.manifest.ranks == (1,)
    # A part copied again is already durable; another rank's part is not its to copy.
    assert copy_part(tiers.memory, tiers.persistent, TAG, rank=1, world_size=2, timeout_s=1)
    marker = parse_marker(tiers.memory.read_bytes(TAG, ".rank-1.json"), "m")
    assert isinstance(marker, RankMarker) and marker.writers == (1,)


def test_checkpoint_ranks_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 (torchrun's variables), with rank 1 absent: what it writes alone commits."""
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    nm.init(str(tmp_path / "root"), rank_timeout_s=30)
    for bad in ([], [0, 0], [-1], ["0"], "0", 0):
        with pytest.raises(nm.InvalidArgumentError, match="ranks must be"):
            nm.Checkpoint(TAG, ranks=bad)  # type: ignore[arg-type]
    with pytest.raises(nm.InvalidArgumentError, match=r"rank\(s\) \[3\].* 2 process"):
        nm.Checkpoint(TAG, ranks=[0, 3]).save("model", {"w": 1})
    with pytest.raises(nm.InvalidArgumentError, match="rank 0 saves item 'model'"):
        nm.Checkpoint("global_step2", ranks=[1]).save("model", {"w": 1})
    assert nm.Checkpoint("global_step3", ranks=[1]).commit() is True  # not its: a no-op
    nm.Checkpoint("global_step4", ranks=[0]).save("model", {"w": 1})
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step4"


def test_a_rank_timeout_names_who_wrote_and_points_to_ranks_when_only_some_saved(
    tmp_path: Path,
) -> None:
    """Rank 0 of 2 saves alone, without `ranks=[0]` (the common `if rank == 0: save`).
    Bug caught: the error said only to raise NEBULA_RANK_TIMEOUT_S, never how to say
    that one rank saves."""
    store = Store(tmp_path)
    begin_tag(store, TAG, rank=0, overwrite=False, world_size=2)
    item = write_item(store, TAG, "model", {"w": 1}, rank=0)
    assert commit_rank(store, TAG, rank=0, world_size=2, items=[item], created_at="t") is None
    with pytest.raises(nm.RankTimeoutError) as raised:
        await_commit(store, TAG, world_size=2, timeout_s=0.2)
    message = str(raised.value)
    assert "rank(s) 1 did not commit their part" in message, message
    assert "rank(s) 0 did" in message, message
    assert f"nm.Checkpoint('{TAG}', ranks=[0])" in message, message
    assert raised.value.missing == [1] and raised.value.wrote == [0]


def test_two_ranks_saving_a_committed_tag_again_at_once_keep_each_others_files(
    tmp_path: Path,
) -> None:
    """Both ranks re-save a committed 2-rank tag at the same moment (DeepSpeed saving
    global_step4 again after a rollback), many times over. Bug caught: the rank that
    removed its old part last took the folder for empty of anything new (the other
    rank's new writer marker and items bear the old names) and removed it with them:
    the other rank's next write found no folder, or its commit an item missing."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    store = Store(tmp_path / "root")
    _part(store, 0, ["r0"])
    _part(store, 1, ["r1"])

    def resave(rank: int, round_: int, start: threading.Barrier) -> None:
        start.wait()
        begin_tag(store, TAG, rank=rank, overwrite=True, world_size=2)
        value = {"w": torch.full((4,), 100 * round_ + rank)}
        items = [write_item(store, TAG, f"r{rank}", value, rank=rank)]
        # Each save of the tag is a generation of its own (session.part_generation).
        generation = f"save {round_}"
        kept = commit_rank(
            store, TAG, rank=rank, world_size=2, items=items, created_at="t", generation=generation
        )
        if kept is None:  # the other rank commits, or this one once the other's part is in
            await_commit(store, TAG, world_size=2, timeout_s=10, generation=generation)

    with ThreadPoolExecutor(2) as pool:
        for round_ in range(60):
            start = threading.Barrier(2)
            for done in [pool.submit(resave, rank, round_, start) for rank in (0, 1)]:
                done.result()  # raises a rank's error (the folder gone, an item missing)
            info = read_committed(store, TAG)
            assert info is not None, f"round {round_}: not committed"
            for rank in (0, 1):
                loaded = torch.load(store.local_path(TAG, f"r{rank}"), weights_only=True)
                assert loaded["w"][0].item() == 100 * round_ + rank, f"round {round_}"


def test_the_last_part_deleted_leaves_the_folder_to_a_rank_saving_the_tag_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 (another live process) saves a 2-rank tag again: its old part is gone, and
    just as rank 1's delete of its own part (retention, a prune) finds the folder empty,
    rank 0 writes its new writer marker, under the name of a deleter's claim. Bug caught:
    the delete took it for one, and removed the folder with it (rank 0's next write found
    no folder: DeepSpeed's re-save of global_step4 after a rollback, 1 run in 4)."""
    import socket
    import subprocess
    import sys

    import nebulaml.protocol.delete as delete

    store = Store(tmp_path / "root")
    _part(store, 0, ["r0"])
    _part(store, 1, ["r1"])
    store.remove(TAG, "manifest.json")  # rank 0's begin_tag(overwrite=True): its old part
    assert delete.delete_part(store, TAG, 0, keep_folder=True)
    saver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    remove_folder = delete._remove_folder

    def rank_0_begins(*args: object, **kwargs: object) -> None:
        marker = {"host": socket.gethostname(), "pid": saver.pid, "rank": 0, "started_at": "t"}
        store.publish((TAG, ".writer-0.json"), json.dumps(marker).encode(), create_only=False)
        remove_folder(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(delete, "_remove_folder", rank_0_begins)
    try:
        assert delete.delete_part(store, TAG, 1)
        files = store.list_files(TAG)
        assert "r1" not in files and ".rank-1.json" not in files
        assert ".writer-0.json" in files
        store.write_bytes((TAG, "r0"), b"rank 0's new item")  # the folder is there
    finally:
        saver.kill()
        saver.wait()
    monkeypatch.setattr(delete, "_remove_folder", remove_folder)
    store.remove(TAG, "r0")
    assert delete.delete_part(store, TAG, 0)  # rank 0's process is gone: a leftover
    assert not store.exists(TAG)


def test_a_follower_exiting_before_its_leader_starts_still_persists_what_it_persists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks of one node commit global_step1..3 and exit without a flush; rank 0's
    thread is slow to start global_step1 (a busy machine: it runs at a lower priority).
    Bug caught (CI, 1 run in 9): rank 1's exit saw no marker of rank 0's yet, took every
    older tag for skipped and dropped it; rank 0 then persisted global_step1 and waited
    60 s for rank 1's part, and its exit failed."""
    import threading

    import nebulaml.runtime.persist_actions as persist_actions

    tiers = [open_tiers(str(tmp_path / "root")) for _ in (0, 1)]
    memory, persistent = tiers[0].memory, tiers[0].persistent
    assert persistent is not None
    part = persist_actions.persist_part
    held, entered = threading.Event(), threading.Event()

    def slow_leader(tiers_: object, tag: str, ranks: RankInfo, **kwargs: object) -> int:
        if ranks.rank == 0 and tag == "global_step1":
            entered.set()
            held.wait(timeout=30)  # until rank 1 is exiting
        return part(tiers_, tag, ranks, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(persist_actions, "persist_part", slow_leader)
    persisters = [
        Persister(t, interval_s=0, retention=5, ranks=RankInfo(r, 2, r, 2), rank_timeout_s=8)
        for r, t in enumerate(tiers)
    ]
    try:
        for step in (1, 2, 3):
            tag = f"global_step{step}"
            for rank in (0, 1):
                begin_tag(memory, tag, rank=rank, overwrite=False, world_size=2)
                item = write_item(memory, tag, f"r{rank}", {"w": step}, rank=rank)
                commit_rank(memory, tag, rank=rank, world_size=2, items=[item], created_at="t")
            for persister in persisters:
                persister.notify_committed(tag)
            if step == 1:  # rank 0 has taken global_step1 up (not superseded by 2 or 3)
                assert entered.wait(timeout=30)
        left: list[str | None] = [None, None]

        def close(rank: int) -> None:
            left[rank] = persisters[rank].close(timeout_s=60)

        closing = [threading.Thread(target=close, args=(r,)) for r in (1, 0)]
        closing[0].start()
        time.sleep(1.0)  # rank 1's exit has looked for rank 0's markers, and found none
        held.set()
        closing[1].start()
        for thread in closing:
            thread.join()
        assert left == [None, None]
        assert persisters[0].error is None, persisters[0].error
        committed = {t for t in ("global_step1", "global_step3") if read_committed(persistent, t)}
        assert committed == {"global_step1", "global_step3"}
        assert read_committed(persistent, "global_step2") is None
        assert "global_step2" not in persistent.list_dirs()  # rank 1 skipped it as rank 0 did
    finally:
        held.set()
        for persister in persisters:
            persister.close(timeout_s=10)


def _commit_both(memory: Store, tag: str, step: int, generation: str | None = None) -> None:
    for rank in (0, 1):
        begin_tag(memory, tag, rank=rank, overwrite=False, world_size=2)
        item = write_item(memory, tag, f"r{rank}", {"w": step}, rank=rank)
        commit_rank(
            memory, tag, rank=rank, world_size=2, items=[item], created_at="t",
            generation=generation,
        )  # fmt: skip


def test_the_leader_commits_at_once_with_the_part_of_a_rank_whose_process_ended(
    tmp_path: Path,
) -> None:
    """Rank 1 of the node wrote its part of global_step1 to the memory tier and died
    before persisting it (torchrun then SIGTERMs rank 0, whose exit persists the newest).
    Bug caught: rank 0 waited rank_timeout_s for a part that could never come (torchrun
    SIGKILLed it 30 s later: every elastic restart cost 30 s) and the checkpoint was
    never committed. While rank 1 lives, rank 0 waits for it as before."""
    from nebulaml.protocol.rank_presence import RankPresence

    tiers = open_tiers(str(tmp_path / "root"))
    memory, persistent = tiers.memory, tiers.persistent
    assert persistent is not None
    _commit_both(memory, TAG, 1)
    rank_1 = RankPresence.take(memory, 1)  # alive: held
    leader = Persister(tiers, interval_s=0, retention=5, ranks=RankInfo(0, 2, 0, 2),
                       rank_timeout_s=2, on_error="raise")  # fmt: skip
    try:
        leader.notify_committed(TAG)
        with pytest.raises(nm.PersistError, match=r"rank\(s\) 1 did not commit their part"):
            leader.flush(TAG, timeout_s=30)
        rank_1.close()  # its process ends
        started = time.monotonic()
        leader.rank_timeout_s = 60
        leader.request(TAG)
        assert leader.flush(TAG, timeout_s=30) == TAG
        assert time.monotonic() - started < 10
    finally:
        leader.close(timeout_s=10)
    info = read_committed(persistent, TAG)
    assert info is not None and {i.rank for i in info.manifest.items} == {0, 1}
    assert torch.load(persistent.local_path(TAG, "r1"), weights_only=True) == {"w": 1}


def test_a_rank_gone_without_its_part_fails_the_commit_at_once(tmp_path: Path) -> None:
    """Rank 1 ended with no part of the tag in the memory tier (killed before its marker):
    the persist fails at once, naming it, instead of after rank_timeout_s."""
    from nebulaml.protocol.rank_presence import RankPresence

    tiers = open_tiers(str(tmp_path / "root"))
    memory, persistent = tiers.memory, tiers.persistent
    assert persistent is not None
    begin_tag(memory, TAG, rank=0, overwrite=False, world_size=2)
    item = write_item(memory, TAG, "r0", {"w": 1}, rank=0)
    commit_rank(memory, TAG, rank=0, world_size=2, items=[item], created_at="t")
    RankPresence.take(memory, 1).close()
    started = time.monotonic()
    with pytest.raises(nm.RankGoneError, match=r"rank\(s\) 1 ended without their part"):
        copy_part(memory, persistent, TAG, rank=0, world_size=2, timeout_s=60,
                  gone=lambda ranks: [r for r in ranks if r == 1])  # fmt: skip
    assert time.monotonic() - started < 10
    assert read_committed(persistent, TAG) is None


def test_a_follower_whose_leader_ended_commits_the_newest_at_exit(tmp_path: Path) -> None:
    """Rank 0 (the leader) died after committing global_step1 and 2 in the memory tier;
    rank 1 exits. Bug caught: rank 1 waited for rank 0's lead, or persisted only its own
    part, and the newest checkpoint both ranks had acknowledged was durable nowhere but
    in RAM."""
    from nebulaml.protocol.rank_presence import RankPresence

    tiers = open_tiers(str(tmp_path / "root"))
    memory, persistent = tiers.memory, tiers.persistent
    assert persistent is not None
    for step in (1, 2):
        _commit_both(memory, f"global_step{step}", step)
    RankPresence.take(memory, 0).close()  # rank 0's process has ended
    follower = Persister(tiers, interval_s=0, retention=5, ranks=RankInfo(1, 2, 1, 2),
                         rank_timeout_s=60)  # fmt: skip
    for step in (1, 2):
        follower.notify_committed(f"global_step{step}")
    started = time.monotonic()
    assert follower.close(timeout_s=30) is None
    assert time.monotonic() - started < 10
    assert read_committed(persistent, "global_step2") is not None
    assert read_committed(persistent, "global_step1") is None


def test_eviction_keeps_the_newest_committed_part_not_one_still_waiting_for_the_others(
    tmp_path: Path,
) -> None:
    """Found by the elastic campaign (on the code before the survivor's takeover, 1
    restart in 30): rank 1's part of global_step6 waited for rank 0's, rank 0 was
    SIGKILLed, and rank 1's eviction took step 6 for its newest and deleted its part of
    global_step5, committed and acknowledged by both: the restart resumed at step 4."""
    tiers = open_tiers(str(tmp_path / "root"))
    memory = tiers.memory
    _commit_both(memory, "global_step5", 5)
    begin_tag(memory, "global_step6", rank=1, overwrite=False, world_size=2)
    item = write_item(memory, "global_step6", "r1", {"w": 6}, rank=1)
    commit_rank(memory, "global_step6", rank=1, world_size=2, items=[item], created_at="t")
    _evict_as(tiers, 1)
    assert read_committed(memory, "global_step5") is not None
    assert ".rank-1.json" in memory.list_files("global_step6")  # in progress: kept too


def _evict_as(tiers: TierSet, rank: int) -> None:
    """One eviction by a persister of rank `rank` of a 2-rank job, which then closes."""
    persister = Persister(tiers, interval_s=3600, retention=5, ranks=RankInfo(rank, 2, rank, 2),
                          rank_timeout_s=5)  # fmt: skip
    try:
        persister.evict_memory()
    finally:
        persister.close(timeout_s=10)


def _commit_rank_0(memory: Store, tag: str) -> None:
    """A checkpoint of a 2-rank job that rank 0 alone writes (Lightning DDP's saves)."""
    begin_tag(memory, tag, rank=0, overwrite=False, world_size=2)
    item = write_item(memory, tag, "state", {"w": 1}, rank=0)
    commit_rank(memory, tag, rank=0, world_size=2, items=[item], created_at="t", ranks=[0])


def test_eviction_never_takes_a_part_this_process_is_still_committing(tmp_path: Path) -> None:
    """Found by a CI run (Lightning DDP, 1 in 4 under load): rank 0 saving `last` again had
    published its rank marker, not yet the manifest, when its persister's eviction ran:
    `last` sorts before every `epoch=...-step=N` tag, so it was taken for an old part
    and deleted, and the save failed (its folder gone)."""
    from nebulaml.format.names import writer_marker_name
    from nebulaml.protocol.markers import writer_record

    tiers = open_tiers(str(tmp_path / "root"))
    memory = tiers.memory
    for tag in ("epoch=0-step=4", "last"):
        _commit_rank_0(memory, tag)
    memory.remove("last", "manifest.json")  # mid-commit: the marker there, not the manifest
    memory.publish(("last", writer_marker_name(0)), writer_record(0), create_only=False)
    _evict_as(tiers, 0)
    assert ".rank-0.json" in memory.list_files("last") and "state" in memory.list_files("last")


def test_eviction_leaves_a_tag_the_training_thread_is_saving_again(tmp_path: Path) -> None:
    """Found by a CI run (Lightning DDP under load): rank 0 saving `last` again (its old
    part persisted, so evictable) while its persister evicted that old part: the delete
    took the new items (same names) and the folder, and the save failed."""
    tiers = open_tiers(str(tmp_path / "root"))
    memory = tiers.memory
    for tag in ("last", "epoch=1-step=8"):
        _commit_rank_0(memory, tag)
    leader = Persister(tiers, interval_s=3600, retention=5, ranks=RankInfo(0, 2, 0, 2),
                       rank_timeout_s=5)  # fmt: skip
    try:
        leader.release("last")  # the training thread begins saving `last` again
        leader.evict_memory()  # `last` sorts first: the old part would be evicted
        assert read_committed(memory, "last") is not None
        leader.notify_committed("last")  # saved: evictable again once superseded
    finally:
        leader.close(timeout_s=10)


def test_a_followers_part_stays_in_the_memory_tier_until_its_leader_commits(
    tmp_path: Path,
) -> None:
    """A restarted 2-rank job persists global_step1, which the crashed run left in the
    memory tier (each rank its part), while global_step2 is newer. Bug caught (a CI run:
    a DeepSpeed rollback loaded global_step2 for global_step1): rank 1, done with its
    part first, evicted it from the memory tier (manifest first) while rank 0 was still
    copying its own, so global_step1 was committed on no tier until rank 0's commit, and
    rank 0's `get_checkpoint("global_step1")` found nothing. Its flush waits for the
    commit, too: before, it reported the checkpoint durable with no manifest there."""
    tiers = open_tiers(str(tmp_path / "root"))
    memory, persistent = tiers.memory, tiers.persistent
    assert persistent is not None
    for step in (1, 2):
        _commit_both(memory, f"global_step{step}", step)
    follower = Persister(tiers, interval_s=3600, retention=5, ranks=RankInfo(1, 2, 1, 2),
                         rank_timeout_s=60)  # fmt: skip
    try:
        follower.request("global_step1")  # the recovery's request, on both ranks
        follower.notify_committed("global_step2")  # then its first save
        deadline = time.monotonic() + 30
        while ".rank-1.json" not in persistent.list_files("global_step1"):
            assert time.monotonic() < deadline, "rank 1 never persisted its part"
            time.sleep(0.02)
        follower.evict_memory()  # what its save of the next step does
        assert read_committed(persistent, "global_step1") is None  # rank 0 still copies
        assert read_committed(memory, "global_step1") is not None  # so this copy stays
        flushed: list[object] = []
        waiting = threading.Thread(
            target=lambda: flushed.append(follower.flush("global_step1", timeout_s=30))
        )
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive()  # not durable yet: the flush waits for the commit
        copy_part(memory, persistent, "global_step1", rank=0, world_size=2, timeout_s=30)
        waiting.join(timeout=30)
        assert flushed == ["global_step1"]
        assert read_committed(persistent, "global_step1") is not None
        deadline = time.monotonic() + 30
        while "global_step1" in [t for t, _created in own_parts(memory, 1)]:
            assert time.monotonic() < deadline, "rank 1's part never left the memory tier"
            time.sleep(0.02)
    finally:
        follower.close(timeout_s=10)


def test_a_part_copied_while_another_nodes_part_of_one_name_is_being_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks on two nodes persist "model" of one save at once; rank 1 has written its file
    but not yet its marker when rank 0 copies. Bug caught: rank 0 saw the file but no
    marker, took the name (unlinking rank 1's file under its write) or failed with EEXIST,
    retried for ever, instead of `ItemCollisionError`."""
    nodes = [Store(tmp_path / f"node{r}") for r in (0, 1)]
    for rank, node in enumerate(nodes):
        begin_tag(node, TAG, rank=rank, overwrite=False, world_size=2)
        item = write_item(node, TAG, "model", {"w": torch.full((64,), rank)}, rank=rank)
        commit_rank(node, TAG, rank=rank, world_size=2, items=[item], created_at="t",
                    generation="run.0")  # fmt: skip
    root = tmp_path / "persistent"
    writing, release = threading.Event(), threading.Event()
    late = Store(root)  # rank 1's view of the persistent tier, held before its marker
    publish = late.publish

    def held_publish(parts: tuple[str, ...], data: bytes, **kw: object) -> None:
        if parts == (TAG, ".rank-1.json"):
            writing.set()
            release.wait(30)
        publish(parts, data, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(late, "publish", held_publish)
    failed: list[BaseException] = []

    def rank1() -> None:
        try:
            copy_part(nodes[1], late, TAG, rank=1, world_size=2, timeout_s=5, wait=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failed.append(exc)

    thread = threading.Thread(target=rank1)
    thread.start()
    try:
        assert writing.wait(30)
        theirs = (root / TAG / "model").read_bytes()
        with pytest.raises(nm.ItemCollisionError, match=r"'model' .* by rank 1 and by rank 0"):
            copy_part(nodes[0], Store(root), TAG, rank=0, world_size=2, timeout_s=5, wait=False)
        assert (root / TAG / "model").read_bytes() == theirs  # rank 1's file, untouched
    finally:
        release.set()
        thread.join(30)
    assert not failed, failed
    assert read_committed(Store(root), TAG) is None
