"""Train a tiny GPT on CPU with nebula checkpoints, kill it, and resume it: `make demo`.

Two modes:

    python examples/train.py                 train (resuming from the newest checkpoint, if any)
    python examples/train.py --demo          the demo: train in a child process, SIGKILL it
                                             mid-run, resume in a second child, prove that the
                                             model, optimizer and step are what was saved

The model is a GPT-style transformer of about 3.4 M parameters (token and position embeddings,
pre-LN blocks with causal self-attention and an MLP, an LM head) trained with AdamW on
synthetic tokens that follow a fixed random permutation of the vocabulary 90% of the time, so
the loss visibly falls within a few dozen steps on two CPU cores.

Checkpoints use nebula exactly as a training script does: `nm.init(root, ...)`, then every
few steps `nm.Checkpoint(f"global_step{step}", 3)` with three saves (model, optimizer,
trainer state; the third save commits), and at start `nm.get_latest_checkpoint()` and
`.load(name)`.

The proof: after each commit returns, the training process appends one fsynced line to a
journal outside the checkpoint root: the tag and a sha256 over every tensor (and
hyper-parameter) of the model's and optimizer's state dicts, and the step. The resumed
process loads the newest checkpoint into a freshly built model and optimizer, digests their
state dicts the same way, and exits non-zero if the digest differs from the journal's.

Not for: benchmarking (see benchmarks/), or multi-process / GPU training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nebulaml as nm

SEED = 1234
DEFAULT_ROOT = "./demo-checkpoints"
ITEMS = ("model", "optimizer", "trainer")  # the three saves of every checkpoint
EXIT_MISMATCH = 2  # the resumed state is not what was saved
EXIT_DEMO_FAILED = 3  # the demo's children did not behave as planned

# Lines the training process prints, and the demo parses (keep the two in sync).
STEP_LINE = re.compile(r"^step (\d+) loss (\d+\.\d+)$")
COMMIT_LINE = re.compile(r"^checkpoint (\S+) committed ")
RESUME_LINE = re.compile(r"^resumed from (\S+) ")


# -- the model -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GPTConfig:
    """The shape of the tiny GPT (about 3.4 M parameters with the defaults)."""

    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only the positions before it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_width)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, `n_layers` blocks, a final LayerNorm and an LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for tokens of shape (batch, seq)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- the data ------------------------------------------------------------------------------
class SyntheticTokens:
    """Batches of token sequences with a learnable pattern, from a seeded generator.

    Each next token is `successor[token]` (a fixed random permutation of the vocabulary) with
    probability `follow_p`, else a uniformly random token. The generator's state is part of
    the checkpoint, so a resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(self, cfg: GPTConfig, batch_size: int, seed: int, follow_p: float = 0.9):
        self.cfg, self.batch_size, self.follow_p = cfg, batch_size, follow_p
        self.successor = torch.randperm(
            cfg.vocab_size, generator=torch.Generator().manual_seed(seed)
        )
        self.generator = torch.Generator().manual_seed(seed + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (the inputs shifted by one), each of shape (batch, seq_len)."""
        n, length, gen = self.batch_size, self.cfg.seq_len + 1, self.generator
        tokens = torch.empty(n, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.cfg.vocab_size, (n,), generator=gen)
        follow = torch.rand(n, length, generator=gen) < self.follow_p
        noise = torch.randint(self.cfg.vocab_size, (n, length), generator=gen)
        for t in range(1, length):
            tokens[:, t] = torch.where(follow[:, t], self.successor[tokens[:, t - 1]], noise[:, t])
        return tokens[:, :-1], tokens[:, 1:]


# -- the proof -----------------------------------------------------------------------------
def _feed(hasher: Any, path: str, obj: Any) -> None:
    """Feed `obj` into `hasher` in a stable order: dict keys sorted, tensors as raw bytes."""
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        hasher.update(f"{path}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _feed(hasher, f"{path}.{key}", obj[key])
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _feed(hasher, f"{path}[{index}]", value)
    else:  # a hyper-parameter: lr, betas, weight_decay, ...
        hasher.update(f"{path}={obj!r}\n".encode())


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> str:
    """sha256 over the model's and optimizer's state dicts and the step."""
    hasher = hashlib.sha256()
    _feed(hasher, "model", model.state_dict())
    _feed(hasher, "optimizer", optimizer.state_dict())
    hasher.update(f"step={step}\n".encode())
    return hasher.hexdigest()


def append_journal(journal: Path, tag: str, step: int, digest: str) -> None:
    """Append one line and fsync it, so that it survives the SIGKILL that follows."""
    line = json.dumps({"tag": tag, "step": step, "sha256": digest}) + "\n"
    with open(journal, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_journal(journal: Path) -> dict[str, dict[str, Any]]:
    """The journal's lines by tag (the last line wins)."""
    if not journal.exists():
        return {}
    lines = journal.read_text(encoding="utf-8").splitlines()
    return {entry["tag"]: entry for entry in map(json.loads, filter(None, lines))}


# -- training ------------------------------------------------------------------------------
def build(cfg: GPTConfig, lr: float) -> tuple[TinyGPT, torch.optim.AdamW]:
    """A freshly initialised model and its optimizer (same seed, same weights, every time)."""
    torch.manual_seed(SEED)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return model, optimizer


def save_checkpoint(
    step: int,
    loss: float,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: SyntheticTokens,
    journal: Path | None,
) -> None:
    """Save and commit `global_step<step>` (the third save commits), then journal it."""
    t0 = time.perf_counter()
    ckpt = nm.Checkpoint(f"global_step{step}", len(ITEMS))
    ckpt.save("model", model.state_dict())
    ckpt.save("optimizer", optimizer.state_dict())
    trainer = {
        "step": step,
        "loss": loss,
        "rng": torch.get_rng_state(),
        "data_rng": data.generator.get_state(),
    }
    ckpt.save("trainer", trainer)  # the third save: committed in the memory tier on return
    blocked_s = time.perf_counter() - t0
    if journal is not None:
        append_journal(journal, ckpt.tag, step, state_digest(model, optimizer, step))
    print(
        f"checkpoint {ckpt.tag} committed (memory tier, training waited {blocked_s:.2f} s)",
        flush=True,
    )


def resume(
    latest: nm.Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: SyntheticTokens,
    journal: Path | None,
) -> int:
    """Load `latest` into `model`, `optimizer` and `data`; return its step.

    With a journal, exit with EXIT_MISMATCH unless the loaded state's digest is the one
    recorded when the checkpoint was committed.
    """
    model.load_state_dict(latest.load("model"))
    optimizer.load_state_dict(latest.load("optimizer"))
    trainer = latest.load("trainer")  # weights_only=True: tensors and plain data only
    step = int(trainer["step"])
    torch.set_rng_state(trainer["rng"])
    data.generator.set_state(trainer["data_rng"])

    tiers = next((c["tiers"] for c in nm.list_checkpoints() if c["tag"] == latest.tag), [])
    where = f"{latest.tag} on tiers [{', '.join(tiers)}]"
    if journal is None:
        print(f"resumed from {where} at step {step} (no journal to compare with)", flush=True)
        return step
    recorded = read_journal(journal).get(latest.tag)
    digest = state_digest(model, optimizer, step)
    if recorded is None:
        print(f"resume check FAILED: {journal} has no line for {latest.tag}", file=sys.stderr)
        raise SystemExit(EXIT_MISMATCH)
    if recorded["sha256"] != digest or recorded["step"] != step:
        print(
            f"resume check FAILED for {latest.tag}: saved step {recorded['step']} sha256 "
            f"{recorded['sha256']}, loaded step {step} sha256 {digest}",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_MISMATCH)
    print(
        f"resumed from {where}: model, optimizer and step {step} identical to what was saved "
        f"(sha256 {digest[:16]})",
        flush=True,
    )
    return step


def train(args: argparse.Namespace) -> int:
    """Train to `args.steps`, checkpointing every `args.ckpt_every` steps; resume if possible."""
    nm.init(
        args.root,
        persistent_time_interval=args.persist_interval,
        num_of_version_in_retention=args.retention,
    )
    cfg = GPTConfig()
    model, optimizer = build(cfg, args.lr)
    data = SyntheticTokens(cfg, args.batch_size, SEED)
    journal = Path(args.journal) if args.journal else None

    latest = nm.get_latest_checkpoint()
    if latest is None:
        step = 0
        params = sum(p.numel() for p in model.parameters())
        print(f"no checkpoint found: training from scratch ({params / 1e6:.2f} M parameters)")
    else:
        step = resume(latest, model, optimizer, data, journal)

    loss = math.nan
    while step < args.steps:
        inputs, targets = data.next_batch()
        logits = model(inputs)
        loss_t = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss_t.backward()
        optimizer.step()
        step, loss = step + 1, loss_t.item()
        print(f"step {step} loss {loss:.6f}", flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint(step, loss, model, optimizer, data, journal)

    t0 = time.perf_counter()
    nm.shutdown(timeout_s=120)  # persist what is pending (exit would do it too) and stop
    waited_s = time.perf_counter() - t0
    if math.isnan(loss):
        print(f"nothing to train: step {step} is already reached (--steps {args.steps})")
    else:
        print(f"finished at step {step}, loss {loss:.3f}; last persist waited {waited_s:.2f} s")
    return 0


# -- the demo ------------------------------------------------------------------------------
def memory_tier_of(root: str) -> Path:
    """The node-local memory tier that nebula pairs with `root`."""
    return Path(nm.memory_tier_path(root))


def looks_like_nebula_root(path: Path) -> bool:
    """True if every entry of `path` is nebula's: the history file, or a tag folder that holds
    a manifest or a writer's marker. A guard, so that `--demo --root` never wipes user data."""
    for entry in path.iterdir():
        if entry.name == "checkpointHistories.csv":
            continue
        if entry.is_dir() and not entry.is_symlink():
            names = [child.name for child in entry.iterdir()]
            if "manifest.json" in names or any(n.startswith((".writer-", ".rank-")) for n in names):
                continue
        return False
    return True


def clear_root(root: str) -> None:
    """Remove the persistent root and its memory tier, so that the demo starts from nothing."""
    persistent = Path(root)
    if persistent.is_dir() and not looks_like_nebula_root(persistent):
        raise SystemExit(f"{root} holds files that are not nebula checkpoints; not clearing it")
    for path in (persistent, memory_tier_of(root)):
        if path.is_dir():
            shutil.rmtree(path)


def say(text: str) -> None:
    print(text, flush=True)


@dataclass(slots=True)
class ChildRun:
    """What the demo saw of one training child."""

    returncode: int = 0
    last_committed: str | None = None  # the tag of the last "committed" line
    resumed_tag: str | None = None  # the tag of the "resumed from" line
    killed: bool = False  # whether the demo sent SIGKILL
    last_step: int = 0  # the last step the child reported
    losses: dict[int, str] = field(default_factory=dict)  # step -> loss, as printed


def run_child(argv: list[str], env: dict[str, str], kill_after: int | None = None) -> ChildRun:
    """Run a training child, relay its checkpoint lines, and SIGKILL it after `kill_after`.

    The kill waits for a step line at or past `kill_after` that follows at least one commit,
    so it lands while the child trains towards its next checkpoint; what the child printed
    before it died is still read. A child still running when this returns (an error, Ctrl-C)
    is killed, so that no process outlives the demo.
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
    run = ChildRun()
    say(f"    child pid {proc.pid} started")
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            if step_match := STEP_LINE.match(line):
                run.last_step = step = int(step_match.group(1))
                run.losses[step] = step_match.group(2)
                due = kill_after is not None and step >= kill_after and run.last_committed
                if due and not run.killed:
                    os.kill(proc.pid, signal.SIGKILL)
                    run.killed = True
                continue
            if commit_match := COMMIT_LINE.match(line):
                run.last_committed = commit_match.group(1)
                loss = float(run.losses.get(run.last_step, "nan"))
                line = f"step {run.last_step:>3}  loss {loss:.3f}  {line}"
            elif resume_match := RESUME_LINE.match(line):
                run.resumed_tag = resume_match.group(1)
            say(f"    {line}")
    finally:
        if proc.poll() is None and not run.killed:
            proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()
        run.returncode = proc.wait()
    return run


def describe_tiers(root: str) -> list[str]:
    """Which tiers hold which checkpoints, newest first, in a line or two."""
    found = nm.list_checkpoints(root)
    lines = [", ".join(f"{c['tag']} [{', '.join(c['tiers'])}]" for c in found) or "nothing"]
    if found and "persistent" not in found[0]["tiers"]:
        lines.append(
            f"({found[0]['tag']} is in the memory tier only: the next nm.init() persists it)"
        )
    return lines


def demo(args: argparse.Namespace) -> int:
    """Train in a child, SIGKILL it mid-run, resume in a second child, check, summarise."""
    started = time.monotonic()
    kill_after = args.kill_after or 3 * args.ckpt_every + max(1, args.ckpt_every // 2)
    if not args.ckpt_every < kill_after < args.steps or kill_after % args.ckpt_every == 0:
        raise SystemExit("--kill-after must fall between two checkpoints, before --steps")
    clear_root(args.root)
    say(
        f"nebula {nm.__version__} demo (torch {torch.__version__}): a tiny GPT on synthetic "
        f"tokens, {args.steps} steps on CPU, a checkpoint every {args.ckpt_every} steps into "
        f"{args.root}"
    )
    with tempfile.TemporaryDirectory(prefix="nebula-demo-") as tmp:
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            *("--root", args.root, "--steps", str(args.steps)),
            *("--ckpt-every", str(args.ckpt_every), "--journal", str(Path(tmp) / "journal")),
            *("--persist-interval", str(args.persist_interval)),
            *("--retention", str(args.retention), "--batch-size", str(args.batch_size)),
            *("--lr", str(args.lr)),
        ]
        # OpenMP threads that spin while they wait make a 2-core machine crawl (5x here)
        # as soon as anything else runs, so the children's threads sleep instead.
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
        say("[1] training, to be killed mid-run")
        first = run_child(argv, env, kill_after)
        if not first.killed or first.returncode != -signal.SIGKILL:
            say(f"demo FAILED: the training child exited with {first.returncode} unkilled")
            return EXIT_DEMO_FAILED
        say(f"[2] SIGKILL after step {first.last_step} (last committed: {first.last_committed})")
        first_line, *more = describe_tiers(args.root)
        say(f"    left behind: {first_line}")
        for line in more:
            say(f"    {line}")
        say("[3] training again: the new process resumes from the newest checkpoint by itself")
        second = run_child(argv, env)
    if second.returncode != 0:
        say(f"demo FAILED: the resumed training child exited with {second.returncode}")
        return second.returncode if second.returncode > 0 else EXIT_DEMO_FAILED
    if second.resumed_tag != first.last_committed:
        say(f"demo FAILED: resumed from {second.resumed_tag}, not {first.last_committed}")
        return EXIT_MISMATCH
    replayed = sorted(set(first.losses) & set(second.losses))
    if replayed:
        same = all(first.losses[s] == second.losses[s] for s in replayed)
        say(
            f"    steps {replayed[0]}-{replayed[-1]} ran before the kill and again after the "
            f"resume: {'identical losses' if same else 'the losses differ (CPU kernels)'}"
        )

    say(f"[4] the nebula command line on {args.root}:")
    for command in (
        ["ls", args.root],
        ["latest", args.root, "--path", "model"],
        ["verify", args.root],
        ["history", args.root, "--limit", "6"],
    ):
        if run_cli(command) != 0:
            say(f"    nebula {' '.join(command)} failed")
            return 2
    say(f"demo passed in {time.monotonic() - started:.0f} s; checkpoints left in {args.root}")
    return 0


def run_cli(args: list[str]) -> int:
    """Run `nebula ARGS` (the console script beside this Python) and show what it printed."""
    exe = Path(sys.executable).parent / "nebula"
    env = dict(os.environ, COLUMNS=os.environ.get("COLUMNS", "110"))
    say(f"  $ nebula {' '.join(args)}")
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, check=False)
    for line in (done.stdout + done.stderr).rstrip().splitlines():
        say(f"    {line}")
    return done.returncode


# -- command line --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", action="store_true", help="run the kill-and-resume demo")
    parser.add_argument(
        "--root", default=DEFAULT_ROOT, help="checkpoint root: a path or URL (--demo: a folder)"
    )
    parser.add_argument("--steps", type=int, default=40, help="train up to this step")
    parser.add_argument("--ckpt-every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--persist-interval", type=float, default=2.0, help="seconds")
    parser.add_argument("--retention", type=int, default=3, help="versions kept persistently")
    parser.add_argument("--journal", help="append each commit's state digest to this file")
    parser.add_argument("--kill-after", type=int, help="demo: SIGKILL after this step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.demo:
        return train(args)
    try:
        return demo(args)
    except KeyboardInterrupt:  # the child has been killed by run_child
        print("demo interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
