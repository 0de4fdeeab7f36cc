"""`accelerator.save_state()` / `load_state()` through nebula, for a Hugging Face
Accelerate training loop.

Example:
    >>> import nebulaml as nm, tempfile, torch
    >>> from accelerate import Accelerator
    >>> import nebulaml.accelerate as nma
    >>> nm.init(tempfile.mkdtemp(), persistent_time_interval=10)
    >>> accelerator = Accelerator(cpu=True)
    >>> model = torch.nn.Linear(2, 2)
    >>> model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters()))
    >>> nma.save_state(accelerator, "global_step10")    # returns after the snapshot
    >>> nma.load_state(accelerator)                     # the newest, on any tier
    'global_step10'

Under several processes rank 0 saves the weights, optimizers and schedulers, every process
its RNG states, and every process commits (call both on every process). What the functions
save is described in nebulaml/integrations/accelerate.py.

Not for: anything without Accelerate (its objects are passed in); the Trainer
(nebulaml.transformers); FSDP, DeepSpeed and Megatron-LM states (refused).
"""

from __future__ import annotations

from nebulaml.integrations.accelerate import load_state, save_state

__all__ = ["load_state", "save_state"]
