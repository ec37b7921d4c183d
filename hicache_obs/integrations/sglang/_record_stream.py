"""The process-wide observer of ``torch.Tensor.record_stream``.

While at least one controller is instrumented, ``torch.Tensor.record_stream`` is a
wrapper (:func:`~hicache_obs._native.record_observer`, compiled where the ``slots``
extension is built): the record is made first (a record that fails was not made), then
reported to the submission running on this thread (``current.sub``), if any. Calls from
other code, and calls on threads with no submission, pass straight through. The last
release puts torch's own method back exactly as it was.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..._native import record_observer

__all__ = ["RECORDS", "RecordStreamObserver", "current"]

class _PerThread(threading.local):
    """Per thread: ``sub``, the submission (``start_writing``/``start_loading`` call) running
    on it, if any. The class holds the default, so a thread that never set it reads it
    without a failed lookup."""

    sub: Any = None


current = _PerThread()


class RecordStreamObserver:
    """Wraps ``torch.Tensor.record_stream`` while it has at least one user (``acquire``/``release``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.original: Any = None
        self.had_own = False

    def acquire(self) -> None:
        with self.lock:
            if self.users == 0:
                self.had_own = "record_stream" in torch.Tensor.__dict__
                self.original = torch.Tensor.record_stream
                torch.Tensor.record_stream = record_observer(self.original, current)  # type: ignore[method-assign]
            self.users += 1

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                if self.had_own:
                    torch.Tensor.record_stream = self.original  # type: ignore[method-assign]
                else:
                    del torch.Tensor.record_stream
                self.original = None


#: The one observer of this process.
RECORDS = RecordStreamObserver()
