"""The Hugging Face Trainer and Accelerate through nebula (issue #20): `NebulaCallback`,
`export_pretrained`, `nebulaml.accelerate.save_state` / `load_state`.

Tiny models built from configs (no downloads). The crash tests run training in children
(hf_child.py): a reference run trains without interruption; another is SIGKILLed right
after a save, and a fresh process resumes from nebula (from the memory tier: nothing else
holds that checkpoint) and trains to the end. The resumed run must match the reference
exactly: the state it starts from, every logged loss after the resume, the final weights.
The models have dropout, so that only a restored RNG gives the same losses.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import warm
from frameworks import REPO, Finished, child_env, require, run_ranks, same

import nebulaml as nm

CHILD = Path(__file__).with_name("hf_child.py")
TRAINER_ITEMS = {"model", "config", "generation_config", "optimizer", "scheduler"}
TRAINER_ITEMS |= {"trainer_state", "rng_state"}


@pytest.fixture(autouse=True)
def _frameworks() -> None:
    require("transformers")
    require("accelerate")


# helpers --------------------------------------------------------------------------------
def _spec(tmp_path: Path, run: str, root: str, **kwargs: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "root": str(tmp_path / root),
        "out": str(tmp_path / f"{run}-{{rank}}.json"),
        "output_dir": str(tmp_path / f"{run}-output"),
        "max_steps": 10,
        "save_steps": 2,
        "interval": 3600,  # the first persist at once, the others an hour later
        "retention": 10,
    }
    spec.update(kwargs)
    return spec


def _children(mode: str, specs: list[Any], env: dict[str, str]) -> list[Finished]:
    """Run one child per spec, at the same time; wait for all."""
    procs = [
        warm.Popen(
            [sys.executable, str(CHILD), mode, json.dumps(spec)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for spec in specs
    ]
    finished = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            finished.append(Finished(proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return finished


def _result(spec: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(Path(spec["out"].format(rank=rank)).read_text())
    return result


def _after(losses: dict[str, Any], step: int) -> dict[str, Any]:
    return {k: v for k, v in losses.items() if int(k) > step}


def _item(root: str, tag: str, name: str) -> Any:
    found = nm.get_checkpoint(tag, root)
    assert found is not None, f"{tag} is not in {root}"
    return found.load(name)


def _crash_and_resume(
    tmp_path: Path, memory_tier: Path, mode: str, **resume: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The reference run and the SIGKILLed one (at the same time), then the resume; returns
    (reference spec, its result, resumed spec, its result)."""
    env = child_env(memory_tier)
    full = _spec(tmp_path, f"{mode}-full", "full", interval=0, flush=True)  # keeps them all
    # Step 2 persisted (the interval's first) before step 4 comes, whatever the load: 4 and 6
    # then wait for the interval, in RAM only.
    crash = _spec(tmp_path, f"{mode}-crash", "run", kill_at=6, flush=[2])
    done_full, done_crash = _children(mode, [full, crash], env)
    assert done_full.returncode == 0, done_full.output[-3000:]
    assert done_crash.returncode == -9, done_crash.output[-3000:]  # SIGKILL after step 6

    newest = nm.list_checkpoints(crash["root"])[0]
    assert newest["tag"] == "global_step6"
    assert newest["tiers"] == ["memory"]  # only RAM holds it: the resume must read it there

    resumed = _spec(tmp_path, f"{mode}-resume", "run", resume=True, **resume)
    (done,) = _children(mode, [resumed], env)
    assert done.returncode == 0, done.output[-3000:]
    return full, _result(full), resumed, _result(resumed)


# the Trainer ----------------------------------------------------------------------------
@pytest.mark.slow
def test_trainer_resumes_after_sigkill_as_if_never_interrupted(
    tmp_path: Path, memory_tier: Path
) -> None:
    """The issue's failure: `train(resume_from_checkpoint=True)` found nothing, as nothing
    is in output_dir. Bugs caught: a save that misses an item (model, optimizer, scheduler,
    RNG, trainer state), a resume that does not take the newest checkpoint from the memory
    tier, RNG not restored (dropout draws other masks: other losses), the step or the
    scheduler off by one, anything written into output_dir."""
    start_state = str(tmp_path / "start-{rank}.pt")
    full, reference, resumed, result = _crash_and_resume(
        tmp_path, memory_tier, "trainer", start_state=start_state
    )

    assert result["start"] == 6
    start = torch.load(start_state.format(rank=0), weights_only=True)
    assert start["global_step"] == 6
    assert same(start["model"], _item(full["root"], "global_step6", "model"))
    assert same(start["optimizer"], _item(full["root"], "global_step6", "optimizer"))
    assert same(start["scheduler"], _item(full["root"], "global_step6", "scheduler"))
    assert same(
        _item(resumed["root"], "global_step6", "rng_state"),
        _item(full["root"], "global_step6", "rng_state"),
    )

    assert list(_after(result["losses"], 6)) == ["7", "8", "9", "10"]
    assert _after(result["losses"], 6) == _after(reference["losses"], 6)  # loss, grad, lr
    assert same(
        _item(resumed["root"], "global_step10", "model"),
        _item(full["root"], "global_step10", "model"),
    )
    assert set(nm.list_checkpoints(resumed["root"])[0]["items"]) == TRAINER_ITEMS
    assert result["output_dir"] == reference["output_dir"] == []  # nothing written there


def _trainer(tmp_path: Path, callback: Any, **kwargs: Any) -> Any:
    from hf_child import Tokens, tiny_gpt2, training_args
    from transformers import Trainer

    extra = {k: kwargs.pop(k) for k in ("eval_dataset", "compute_metrics") if k in kwargs}
    return Trainer(
        model=tiny_gpt2(),
        args=training_args(str(tmp_path / "output"), **kwargs),
        train_dataset=Tokens(),
        callbacks=[callback],
        **extra,
    )


@pytest.mark.slow
def test_save_total_limit_is_the_retention_and_a_path_resumes(tmp_path: Path) -> None:
    """Bugs caught: save_total_limit not reaching nebula's retention, a checkpoint path
    (`output/checkpoint-5`, which does not exist) not naming its nebula tag, saving a step
    again after resuming from an older one refused (the tag exists)."""
    from transformers import TrainerCallback

    from nebulaml.runtime import session
    from nebulaml.transformers import NebulaCallback

    class PersistEach(TrainerCallback):  # the interval skips none: retention decides alone
        def on_save(self, *_args: Any, **_kwargs: Any) -> None:
            nm.flush_persistence()

    root = str(tmp_path / "root")
    callback = NebulaCallback(persistent_storage_path=root, persistent_time_interval=0)
    trainer = _trainer(tmp_path, callback, max_steps=6, save_steps=1, save_total_limit=2)
    trainer.add_callback(PersistEach())
    trainer.train()
    live = session.live()
    assert live is not None and live.config.num_of_version_in_retention == 2
    durable = [c["tag"] for c in nm.list_checkpoints(root) if "persistent" in c["tiers"]]
    assert durable == ["global_step6", "global_step5"]
    assert not (tmp_path / "output").exists() or not list((tmp_path / "output").iterdir())

    again = NebulaCallback(persistent_storage_path=root, persistent_time_interval=0)
    trainer = _trainer(tmp_path, again, max_steps=6, save_steps=1, save_total_limit=2)
    trainer.train(resume_from_checkpoint=str(tmp_path / "output" / "checkpoint-5"))
    assert [h["step"] for h in trainer.state.log_history if "loss" in h][-1] == 6
    assert trainer.state.global_step == 6


# docs/integrations.md's Trainer code ends with this line, for a job's first run and every
# restart alike; the test below runs it (`root` is the callback's persistent_storage_path).
DOCUMENTED_RESUME = "trainer.train(resume_from_checkpoint=bool(nm.list_checkpoints(root)))"


def test_resume_with_nothing_saved_starts_fresh_and_says_where_it_looked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One script starts a job and resumes it (`resume_from_checkpoint=True`): its first
    run has nothing to resume. Bugs caught: it raised ValueError, as the Trainer alone
    does, so the script needed a special case for its first run; the documented line
    (docs/integrations.md), which is right with or without that, not resuming a restart,
    or not the one the docs show."""
    from nebulaml.transformers import NebulaCallback

    docs = (REPO / "docs" / "integrations.md").read_text(encoding="utf-8")
    assert DOCUMENTED_RESUME in docs
    root = str(tmp_path / "root")
    callback = NebulaCallback(persistent_storage_path=root)
    trainer = _trainer(tmp_path, callback, max_steps=2, save_steps=2)
    assert bool(nm.list_checkpoints(root)) is False  # what the documented line passes now
    with caplog.at_level(logging.INFO, logger="nebulaml"):
        trainer.train(resume_from_checkpoint=True)
    said = [r.getMessage() for r in caplog.records if "to resume from" in r.getMessage()]
    assert len(said) == 1 and root in said[0], said
    assert trainer.state.global_step == 2  # trained from the start
    assert [c["tag"] for c in nm.list_checkpoints(root)] == ["global_step2"]

    # The restart, as documented: resumes from global_step2 and trains steps 3 and 4.
    callback = NebulaCallback(persistent_storage_path=root)
    trainer = _trainer(tmp_path, callback, max_steps=4, save_steps=2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nebulaml"):
        trainer.train(resume_from_checkpoint=bool(nm.list_checkpoints(root)))  # as documented
    assert "resuming from nebula checkpoint 'global_step2'" in caplog.messages
    assert trainer.state.global_step == 4
    assert [c["tag"] for c in nm.list_checkpoints(root)] == ["global_step4", "global_step2"]


def test_load_best_model_at_end_through_the_best_label(tmp_path: Path) -> None:
    """Evaluations score 0.5, 0.9, 0.2, 0.1 at steps 2, 4, 6, 8: step 4 is the best.
    Bugs caught: the best checkpoint not labelled (retention with save_total_limit=1
    would delete it), `load_best_model_at_end` not loading it from nebula, a checkpoint
    that was the best once (step 2) kept for ever by its label."""
    from hf_child import Tokens

    from nebulaml.transformers import NebulaCallback

    root = str(tmp_path / "root")
    scores = iter([0.5, 0.9, 0.2, 0.1])
    callback = NebulaCallback(persistent_storage_path=root, persistent_time_interval=0)
    trainer = _trainer(
        tmp_path,
        callback,
        max_steps=8,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=8,
        load_best_model_at_end=True,
        metric_for_best_model="score",
        greater_is_better=True,
        save_total_limit=1,
        eval_dataset=Tokens(8, seed=1),
        compute_metrics=lambda _prediction: {"score": next(scores)},
    )
    trainer.train()
    nm.flush_persistence()

    assert trainer.state.best_model_checkpoint == str(tmp_path / "output" / "checkpoint-4")
    best = _item(root, "global_step4", "model")
    assert same(trainer.model.state_dict(), best)
    assert not same(best, _item(root, "global_step8", "model"))
    listed = {c["tag"]: c for c in nm.list_checkpoints(root) if "persistent" in c["tiers"]}
    assert sorted(listed) == ["global_step4", "global_step8"]
    assert listed["global_step4"]["labels"] == ["best", "transformers"]


@pytest.mark.slow
def test_the_checkpoints_nebula_keeps_are_those_the_trainer_keeps(tmp_path: Path) -> None:
    """The same Trainer (save_total_limit=2, the best model kept, a save every 2 steps,
    the best at step 2 for good) runs on its own, writing checkpoint folders, then with
    NebulaCallback, every save persisted. Bug caught: nebula's own count deciding (the
    best kept beside the 2 newest: 3 where the Trainer keeps 2)."""
    from hf_child import Tokens
    from transformers import TrainerCallback

    from nebulaml.transformers import NebulaCallback

    def run(where: Path, callback: Any) -> Any:
        scores = iter([0.9, 0.5, 0.2, 0.1, 0.3, 0.4])
        trainer = _trainer(
            where,
            callback,
            max_steps=12,
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=8,
            load_best_model_at_end=True,
            metric_for_best_model="score",
            greater_is_better=True,
            save_total_limit=2,
            eval_dataset=Tokens(8, seed=1),
            compute_metrics=lambda _prediction: {"score": next(scores)},
        )
        trainer.train()
        return trainer

    native = run(tmp_path / "native", TrainerCallback())
    kept = sorted(p.name for p in (tmp_path / "native" / "output").glob("checkpoint-*"))
    assert kept == ["checkpoint-12", "checkpoint-2"]  # the newest and the best

    root = str(tmp_path / "root")
    ours = run(tmp_path / "nebula", NebulaCallback(root, persistent_time_interval=0))
    nm.flush_persistence()
    listed = {c["tag"]: c for c in nm.list_checkpoints(root)}
    assert sorted(listed) == ["global_step12", "global_step2"], listed
    assert all("persistent" in c["tiers"] for c in listed.values())
    assert ours.state.best_model_checkpoint.endswith("checkpoint-2")
    assert native.state.best_model_checkpoint.endswith("checkpoint-2")


def test_export_loads_with_from_pretrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bugs caught: an export without config.json or model.safetensors, tied weights
    written twice or lost (lm_head is transformer.wte), weights not the checkpoint's."""
    from transformers import AutoModel, AutoModelForCausalLM, GPT2LMHeadModel, GPT2Model

    from nebulaml.transformers import NebulaCallback, export_pretrained

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = str(tmp_path / "root")
    callback = NebulaCallback(persistent_storage_path=root, persistent_time_interval=0)
    trainer = _trainer(tmp_path, callback, max_steps=3, save_steps=3)
    trainer.train()
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    dest = export_pretrained(root, "global_step3", tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(dest))
    causal = AutoModelForCausalLM.from_pretrained(dest)
    assert isinstance(causal, GPT2LMHeadModel)
    assert same(causal.state_dict(), trained)
    assert causal.lm_head.weight.data_ptr() == causal.transformer.wte.weight.data_ptr()
    base = AutoModel.from_pretrained(dest)
    assert isinstance(base, GPT2Model)
    prefix = "transformer."
    body = {k[len(prefix) :]: v for k, v in trained.items() if k.startswith(prefix)}
    assert same(base.state_dict(), body)
    assert export_pretrained(root, None, tmp_path / "newest") == tmp_path / "newest"
    # The files follow the umask (model.safetensors was 0600: another user's server could
    # not read it), unless private.
    old_mask = os.umask(0o027)
    try:
        shared = export_pretrained(root, None, tmp_path / "shared")
        private = export_pretrained(root, None, tmp_path / "private", private=True)
    finally:
        os.umask(old_mask)
    for folder, mode in ((shared, 0o640), (private, 0o600)):
        modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
        assert modes["model.safetensors"] == modes["config.json"] == mode, modes
        assert set(modes.values()) == {mode}
    assert private.stat().st_mode & 0o777 == 0o700


def test_a_trainer_without_the_callback_is_left_alone(tmp_path: Path) -> None:
    """The hooks go on the instance the callback belongs to, never on the class."""
    from transformers import Trainer, TrainerCallback

    from nebulaml.transformers import NebulaCallback

    hooked = _trainer(tmp_path, NebulaCallback(persistent_storage_path=str(tmp_path / "r")))
    plain = _trainer(tmp_path, TrainerCallback())
    assert "_save_checkpoint" in vars(hooked) and "train" in vars(hooked)
    assert "_save_checkpoint" not in vars(plain)
    assert plain._save_checkpoint.__func__ is Trainer._save_checkpoint


# DDP ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)  # two launches of two ranks: slow only on a crowded machine
def test_ddp_trainer_saves_through_rank_0_and_resumes_on_both_ranks(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Two gloo processes. The first launch trains a reference run to step 8, then another
    run that stops after its save at step 4; a second launch resumes that one on both
    ranks. Bugs caught: every rank saving the weights (or waiting for parts that never
    come), a rank's RNG or optimizer state not restored (its dropout masks or Adam steps
    differ, and so does the averaged loss), the ranks resuming from different steps."""
    env = child_env(memory_tier)
    full = _spec(tmp_path, "ddp-full", "full", max_steps=8, interval=0, flush=True)
    stop = _spec(tmp_path, "ddp-stop", "run", max_steps=8, stop_at=4)
    argv = [sys.executable, str(CHILD), "trainer"]
    for done in run_ranks([*argv, json.dumps([full, stop])], 2, env):
        assert done.returncode == 0, done.output[-3000:]

    manifest = nm.inspect_checkpoint(stop["root"], "global_step4")["manifest"]
    ranks = {item["name"]: item["rank"] for item in manifest["items"]}
    shared = TRAINER_ITEMS - {"rng_state"}
    assert ranks == {**dict.fromkeys(shared, 0), "rng_state_0": 0, "rng_state_1": 1}
    assert manifest["world_size"] == 2

    start_state = str(tmp_path / "start-{rank}.pt")
    resumed = _spec(
        tmp_path, "ddp-resume", "run", max_steps=8, resume=True, start_state=start_state
    )
    for done in run_ranks([*argv, json.dumps(resumed)], 2, env):
        assert done.returncode == 0, done.output[-3000:]
    reference = _result(full)
    for rank in (0, 1):
        result = _result(resumed, rank)
        assert result["start"] == 4
        start = torch.load(start_state.format(rank=rank), weights_only=True)
        assert same(start["optimizer"], _item(full["root"], "global_step4", "optimizer"))
        assert _after(result["losses"], 4) == _after(reference["losses"], 4)
    assert same(
        _item(resumed["root"], "global_step8", "model"),
        _item(full["root"], "global_step8", "model"),
    )
    # Three clean 2-rank exits (two runs in one launch, then one): nothing left behind.
    assert [p for p in memory_tier.rglob("global_step*")] == []


# Accelerate -----------------------------------------------------------------------------
@pytest.mark.slow
def test_accelerate_save_state_resumes_after_sigkill(tmp_path: Path, memory_tier: Path) -> None:
    """`nebulaml.accelerate.save_state` every 2 steps, SIGKILL after step 6, `load_state`
    in a fresh process. Bugs caught: any state not restored (model, optimizer, scheduler,
    RNG: the dropout masks), the newest checkpoint not found in the memory tier."""
    full, reference, resumed, result = _crash_and_resume(tmp_path, memory_tier, "accelerate")
    assert result["start"] == 6
    assert _after(result["losses"], 6) == _after(reference["losses"], 6)
    assert same(
        _item(resumed["root"], "global_step10", "model"),
        _item(full["root"], "global_step10", "model"),
    )
    items = set(nm.list_checkpoints(resumed["root"])[0]["items"])
    assert items == {"model", "optimizer", "scheduler", "accelerate_state", "rng_state_0"}


@pytest.mark.slow
def test_accelerate_clean_2_rank_exits_leave_nothing_in_the_memory_tier(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Two gloo processes save_state every 2 steps and exit without a flush, three runs
    one after another (the leak depended on timing: 2 runs in 2). Bug caught: rank 1
    finished first and kept its parts of the newest checkpoint in the memory tier, which
    nothing released after the job."""
    runs = [_spec(tmp_path, f"exit{n}", f"root{n}", max_steps=6, interval=0) for n in range(3)]
    argv = [sys.executable, str(CHILD), "accelerate", json.dumps(runs)]
    for done in run_ranks(argv, 2, child_env(memory_tier)):
        assert done.returncode == 0, done.output[-3000:]
    for spec in runs:
        manifest = nm.inspect_checkpoint(spec["root"], "global_step6")["manifest"]
        assert {item["rank"] for item in manifest["items"]} == {0, 1}
        assert (Path(spec["root"]) / "global_step6" / "manifest.json").exists()  # durable
    assert [p for p in memory_tier.rglob("global_step*")] == []


def test_accelerate_helpers_in_process(tmp_path: Path) -> None:
    """Registered objects and the step and save iteration come back; a missing tag is an
    error, no checkpoint at all is None."""
    from accelerate import Accelerator

    import nebulaml.accelerate as nma

    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.n = state["n"]

    nm.init(str(tmp_path / "root"), persistent_time_interval=0)
    accelerator = Accelerator(cpu=True)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model = torch.nn.Linear(2, 2)
    model, _optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert nma.load_state(accelerator) is None
    counter.n, accelerator.step = 7, 3
    nma.save_state(accelerator, "global_step3")
    assert accelerator.save_iteration == 1
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    counter.n, accelerator.step, accelerator.project_configuration.iteration = 0, 0, 0
    with torch.no_grad():
        model.weight.add_(1.0)
    assert nma.load_state(accelerator, "global_step3") == "global_step3"
    assert (counter.n, accelerator.step, accelerator.save_iteration) == (7, 3, 1)
    assert same(model.state_dict(), weights)
    with pytest.raises(nm.CheckpointNotFoundError):
        nma.load_state(accelerator, "global_step99")
    assert nm.list_checkpoints()[0]["items"] == [
        "accelerate_state",
        "custom_checkpoint_0",
        "model",
        "optimizer",
        "rng_state_0",
    ]
