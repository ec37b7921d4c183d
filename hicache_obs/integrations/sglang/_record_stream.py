"""The process-wide observer of ``torch.Tensor.record_stream``.

While at least one controller is instrumented, ``torch.Tensor.record_stream`` is a
wrapper: the record is made first (a record that fails was not made), then reported to
the submission running on this thread (``current.sub``), if any. Calls from other code,
and calls on threads with no submission, pass straight through. The last release puts
torch's own method back exactly as it was.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["RECORDS", "RecordStreamObserver", "current"]

class _PerThread(threading.local):
    """Per thread: ``sub``, the submission (``start_writing``/``start_loading`` call) running
    on it, if any; ``recording``, set while a record is being made. The class holds the
    defaults, so a thread that never set them reads them without a failed lookup."""

    sub: Any = None
    recording: bool = False


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
                original = self.original

                def record_stream(tensor: torch.Tensor, stream: Any) -> None:
                    cur = current
                    sub = cur.sub
                    if sub is None or cur.recording:  # no submission; torch-function dispatch calls us again
                        return original(tensor, stream)  # type: ignore[no-any-return]
                    cur.recording = True
                    try:
                        original(tensor, stream)  # a record that fails was not made
                    finally:
                        cur.recording = False
                    sub.records.append((tensor, stream))
                    return None

                record_stream.__doc__ = original.__doc__
                record_stream.__wrapped__ = original  # type: ignore[attr-defined]
                torch.Tensor.record_stream = record_stream  # type: ignore[method-assign, assignment]
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
