"""Framework classes that loading allows under weights_only=True, while that framework loads.

DeepSpeed's checkpoint files hold a few of DeepSpeed's own plain-data objects beside the
tensors (the loss scaler, the ZeRO stage enum, the fragment addresses of ZeRO's flat
buffers). torch's weights-only unpickler refuses any class it does not know, so the items
DeepSpeed writes through nebula would raise `UnsafeCheckpointError` when DeepSpeed loads
them back (its own `torch.save` engine simply loads with weights_only=False).

Nebula keeps weights_only=True and allows exactly those classes, and only while the process
runs DeepSpeed's Nebula engine (DeepSpeed imports that module only when its config enables
`"nebula"`): the caller is then DeepSpeed, loading the files it wrote. Each class is inert
data: the unpickler looks an enum member up by value, or creates the object without calling
its constructor and sets its attributes; none of them runs code from the file. Any other
class in a pickle is still refused. The classes are taken from modules that are already
imported; this module never imports a framework.

Not for: a general trust switch. A caller that trusts a file passes weights_only=False; a
caller that trusts more classes uses `torch.serialization.safe_globals([...])` around the load.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class FrameworkAllowlist:
    """Classes of one framework, allowed while `trigger_module` is imported."""

    framework: str
    trigger_module: str
    classes: tuple[tuple[str, str], ...]  # (module, class name)


DEEPSPEED = FrameworkAllowlist(
    framework="deepspeed",
    trigger_module="deepspeed.runtime.checkpoint_engine.nebula_checkpoint_engine",
    classes=(
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ),
)
FRAMEWORKS: tuple[FrameworkAllowlist, ...] = (DEEPSPEED,)


def active_classes(frameworks: tuple[FrameworkAllowlist, ...] = FRAMEWORKS) -> list[type]:
    """The allowed classes of every framework whose trigger module is imported.

    Example:
        >>> active_classes() if "deepspeed" not in sys.modules else []
        []
    """
    found: list[type] = []
    for entry in frameworks:
        if entry.trigger_module not in sys.modules:
            continue
        for module_name, class_name in entry.classes:
            module = sys.modules.get(module_name)
            cls = getattr(module, class_name, None) if module is not None else None
            if isinstance(cls, type):
                found.append(cls)
    return found


# The weights-only allowlist is process-wide in torch; several threads may load at once.
# A class nebula added stays allowed until the last of those loads ends, and a class the
# caller had allowed already is never taken away.
_lock = threading.Lock()
_holds: dict[type, tuple[int, Any]] = {}  # class -> (loads relying on it, torch's context)


@contextlib.contextmanager
def allowed(classes: list[type]) -> Iterator[None]:
    """Allow `classes` in torch's weights-only unpickler for the duration of a load."""
    if not classes:
        yield
        return
    import torch.serialization

    held: list[type] = []
    with _lock:
        already = set(torch.serialization.get_safe_globals())
        for cls in classes:
            if cls in _holds:
                count, context = _holds[cls]
                _holds[cls] = (count + 1, context)
                held.append(cls)
            elif cls not in already:
                context = torch.serialization.safe_globals([cls])
                context.__enter__()
                _holds[cls] = (1, context)
                held.append(cls)
    try:
        yield
    finally:
        with _lock:
            for cls in held:
                count, context = _holds[cls]
                if count > 1:
                    _holds[cls] = (count - 1, context)
                else:
                    del _holds[cls]
                    context.__exit__(None, None, None)
