"""Pure-torch stand-ins for the KV-transfer kernels of SGLang's HiCache host pools (see :mod:`.kvcacheio`)."""

from .kvcacheio import *  # noqa: F403
from .kvcacheio import __all__ as __all__
from .kvcacheio import _flatten as _flatten
from .kvcacheio import _plain as _plain
