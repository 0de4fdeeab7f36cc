"""torch_nebula: the name DeepSpeed's Nebula checkpoint engine imports.

It is the same library as `nebulaml`: the very same objects, re-exported, so a checkpoint
saved through one name is found and loaded through the other. The differences, for
DeepSpeed (nebulaml.integrations.deepspeed): `torch_nebula.Checkpoint` is the subclass of
`nebulaml.Checkpoint` whose save of a tag already committed replaces it, as DeepSpeed's own
engine overwrites a tag saved again (`nebulaml.Checkpoint` refuses it unless
`overwrite=True`); `torch_nebula.get_checkpoint` warns when the tag is not there (the
engine then loads the newest instead); `torch_nebula.init`, called by DeepSpeed's engine,
also takes nebula's own keys of the ds_config's `"nebula"` block (`"peer_replicas": 1`),
which the engine does not pass.

Example:
    >>> import nebulaml, torch_nebula
    >>> torch_nebula.init.__wrapped__ is nebulaml.init
    True
    >>> issubclass(torch_nebula.Checkpoint, nebulaml.Checkpoint)
    True
"""

from nebulaml import *  # noqa: F403
from nebulaml import __all__, __version__  # noqa: F401
from nebulaml.integrations.deepspeed import (
    Checkpoint,  # noqa: F401 - replaces nebulaml's
    get_checkpoint,  # noqa: F401 - warns when missing
    init,  # noqa: F401 - reads the ds_config's block
)
