"""NebulaCheckpointIO and NebulaCallback for `pytorch_lightning` (`import pytorch_lightning as pl`).

The classes of nebulaml.lightning (for `lightning`: `lightning.pytorch`), made on this
package's bases by `declare` in nebulaml/integrations/lightning_common.py, which describes
what they do. `nm.NebulaCheckpointIO` and `nm.NebulaCallback` pick the module of the
package the program imported. Not for: anything without Lightning; importing this module
imports pytorch_lightning.

Example:
    >>> import nebulaml as nm, tempfile
    >>> from pytorch_lightning import Trainer
    >>> from nebulaml.pytorch_lightning import NebulaCallback, NebulaCheckpointIO
    >>> callback = NebulaCallback(every_n_train_steps=5,
    ...                           config_params={"persistent_storage_path": tempfile.mkdtemp()})
    >>> trainer = Trainer(plugins=[NebulaCheckpointIO()], callbacks=[callback], logger=False)
"""

from __future__ import annotations

from nebulaml.integrations import lightning_common

__all__ = ["NebulaCallback", "NebulaCheckpointIO"]

NebulaCheckpointIO, NebulaCallback = lightning_common.declare("pytorch_lightning", __name__)
