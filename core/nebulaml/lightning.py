"""NebulaCheckpointIO and NebulaCallback for `lightning` (`import lightning.pytorch as pl`).

Example:
    >>> import nebulaml as nm, tempfile
    >>> from lightning.pytorch import Trainer
    >>> from nebulaml.lightning import NebulaCallback, NebulaCheckpointIO
    >>> callback = NebulaCallback(every_n_train_steps=5,
    ...                           config_params={"persistent_storage_path": tempfile.mkdtemp()})
    >>> trainer = Trainer(plugins=[NebulaCheckpointIO()], callbacks=[callback], logger=False)

For `pytorch_lightning` use nebulaml.pytorch_lightning; `nm.NebulaCheckpointIO` and
`nm.NebulaCallback` pick the module of the package the program imported. What the classes
do is described in nebulaml/integrations/lightning_common.py, whose `declare` makes them
on this package's bases.

Not for: anything without Lightning; importing this module imports lightning.
"""

from __future__ import annotations

from nebulaml.integrations.lightning_common import declare

__all__ = ["NebulaCallback", "NebulaCheckpointIO"]

NebulaCheckpointIO, NebulaCallback = declare("lightning.pytorch", __name__)
