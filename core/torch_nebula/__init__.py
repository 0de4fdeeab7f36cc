"""torch_nebula: the name DeepSpeed's Nebula checkpoint engine imports.

It is the same library as `nebulaml`: the very same objects, re-exported, so a checkpoint
saved through one name is found and loaded through the other.

Example:
    >>> import nebulaml, torch_nebula
    >>> torch_nebula.Checkpoint is nebulaml.Checkpoint
    True
"""

from nebulaml import *  # noqa: F403
from nebulaml import __all__, __version__  # noqa: F401
