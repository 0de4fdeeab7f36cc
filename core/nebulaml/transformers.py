"""NebulaCallback and export_pretrained for the Hugging Face Trainer (`transformers`).

Example:
    >>> import tempfile
    >>> from nebulaml.transformers import NebulaCallback, tag_for_path
    >>> callback = NebulaCallback(persistent_storage_path=tempfile.mkdtemp(),
    ...                           persistent_time_interval=10)
    >>> tag_for_path("out/checkpoint-500")
    'global_step500'

`Trainer(..., callbacks=[callback])` saves every checkpoint the Trainer makes through
nebula, and `trainer.train(resume_from_checkpoint=True)` resumes from nebula's newest;
`export_pretrained(root, tag, dest)` writes a checkpoint as a `from_pretrained` folder.
How the Trainer is hooked is described in nebulaml/integrations/transformers.py.

Not for: anything without transformers (importing this module imports it); Accelerate's
own loop (nebulaml.accelerate).
"""

from __future__ import annotations

from nebulaml.integrations.trainer_export import export_pretrained
from nebulaml.integrations.trainer_tags import tag_for_path, tag_for_step
from nebulaml.integrations.transformers import NebulaCallback

__all__ = ["NebulaCallback", "export_pretrained", "tag_for_path", "tag_for_step"]
