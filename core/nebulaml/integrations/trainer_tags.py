"""The Trainer's checkpoint folders as nebula tags: the tag of a step, the tag a
`checkpoint-<N>` path names, and which tags the Trainer's own rotation deletes.

May import: `nebulaml.format` and transformers (its folder names and rotation rule).

Not for: saving or resuming (trainer_saving.py, trainer_resuming.py); Lightning's tags
(lightning_common.py).
"""

from __future__ import annotations

import os
import re
import tempfile

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from nebulaml.format.names import validate_name

TAG_PREFIX = "global_step"
STEP_TAG = TAG_PREFIX + "{}"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def tag_for_step(step: int) -> str:
    """The nebula tag of the Trainer's checkpoint at `step`.

    Example:
        >>> tag_for_step(500)
        'global_step500'
    """
    return STEP_TAG.format(int(step))


def tag_for_path(path: str | os.PathLike[str]) -> str:
    """The nebula tag a Trainer checkpoint path names: `.../checkpoint-500` is
    `global_step500`; any other last component is a tag as it is.

    Example:
        >>> tag_for_path("out/checkpoint-500"), tag_for_path("out/global_step7/")
        ('global_step500', 'global_step7')
    """
    name = os.path.basename(os.fspath(path).rstrip("/\\"))
    match = _CHECKPOINT_RE.match(name)
    if match:
        return tag_for_step(int(match.group(1)))
    return validate_name("tag", name)


def rotated_out(steps: dict[str, int | None], limit: int, best_step: int | None) -> list[str]:
    """The tags (of `steps`: tag -> step) that the Trainer's `rotate_checkpoints` would
    delete with `save_total_limit=limit` and the best checkpoint at `best_step`: it runs on
    a scratch folder of empty `checkpoint-<N>` folders, so that the Trainer's own rule
    decides, whatever its version.

    Example:
        >>> rotated_out({f"global_step{n}": n for n in (4, 8, 12, 16)}, 2, 8)
        ['global_step4', 'global_step12']
    """
    from transformers.trainer_utils import rotate_checkpoints

    by_step = {step: tag for tag, step in steps.items() if step is not None}
    with tempfile.TemporaryDirectory(prefix="nebula-rotation-") as scratch:
        for step in by_step:
            os.mkdir(os.path.join(scratch, f"{PREFIX_CHECKPOINT_DIR}-{step}"))
        best = None
        if best_step in by_step:
            best = os.path.join(scratch, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
        rotate_checkpoints(scratch, limit, best, use_mtime=False)
        left = set(os.listdir(scratch))
    return [t for s, t in sorted(by_step.items()) if f"{PREFIX_CHECKPOINT_DIR}-{s}" not in left]
