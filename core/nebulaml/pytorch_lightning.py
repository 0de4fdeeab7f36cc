"""NebulaCheckpointIO and NebulaCallback for `pytorch_lightning` (`import pytorch_lightning as pl`).

Example:
    >>> import nebulaml as nm, tempfile
    >>> from pytorch_lightning import Trainer
    >>> from nebulaml.pytorch_lightning import NebulaCallback, NebulaCheckpointIO
    >>> callback = NebulaCallback(every_n_train_steps=5,
    ...                           config_params={"persistent_storage_path": tempfile.mkdtemp()})
    >>> trainer = Trainer(plugins=[NebulaCheckpointIO()], callbacks=[callback], logger=False)

For `lightning` (`lightning.pytorch`) use nebulaml.lightning; `nm.NebulaCheckpointIO` and
`nm.NebulaCallback` pick the module of the package the program imported. What the classes
do is described in nebulaml/integrations/lightning_common.py.

Not for: anything without Lightning; importing this module imports pytorch_lightning.
"""

from __future__ import annotations

from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import CheckpointIO

from nebulaml.integrations.lightning_common import CallbackMixin, CheckpointIOMixin

__all__ = ["NebulaCallback", "NebulaCheckpointIO"]


class NebulaCheckpointIO(CheckpointIOMixin, CheckpointIO):
    """Lightning's CheckpointIO through nebula: `Trainer(plugins=[NebulaCheckpointIO()])`.

    A checkpoint path names a nebula tag (the file name without `.ckpt`) holding the item
    "checkpoint". `trainer.save_checkpoint(path, storage_options={"is_best": True,
    "persist_path": root})` labels it "best" (kept by retention and prune) and saves it into
    `root`. Loading verifies it and uses weights_only=True unless told False.
    """


class NebulaCallback(CallbackMixin, ModelCheckpoint):
    """ModelCheckpoint that starts nebula: `NebulaCallback(<ModelCheckpoint arguments>,
    config_params={"persistent_storage_path": ..., ...})` calls `nm.init(**config_params)`.

    Use it with `NebulaCheckpointIO` in the Trainer's plugins; it warns if it is without.
    """

    _checkpoint_io_class = NebulaCheckpointIO
