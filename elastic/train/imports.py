"""Heavy imports the driver makes on threads beside its other work (the world's store, TensorBoard).

torch's first import is not safe from two threads at once: the second meets a partially
initialized `torch` and fails ("cannot import name ... from partially initialized module"). The
driver's background imports of torch's modules go through `import_beside`, one at a time.
"""

from __future__ import annotations

import importlib
import threading

_LOCK = threading.Lock()


def import_beside(name: str):
    """Import the module `name` (e.g. "torch.distributed") holding the driver's one import lock."""
    with _LOCK:
        return importlib.import_module(name)
