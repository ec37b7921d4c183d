"""The pipe between the parent and its sink host child: frames, their kinds, the pipe's size.

A frame is ``HEADER`` (kind, payload length) and the payload: ``EVENTS`` (a msgpack list
of events), ``FLUSH`` (a token the reply echoes) or ``CLOSE``. The child answers on its
reply descriptor with one JSON object per line.
"""

from __future__ import annotations

import fcntl
import struct
from typing import Any

__all__ = ["CLOSE", "EVENTS", "FLUSH", "F_SETPIPE_SZ", "HEADER", "PIPE_BYTES", "read_exact"]

#: The size asked of the kernel for the pipe to the child (Linux ``F_SETPIPE_SZ``; an
#: unprivileged process may ask up to ``/proc/sys/fs/pipe-max-size``, 1 MiB by default).
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)

HEADER = struct.Struct("<cI")  # frame kind, payload length
EVENTS, FLUSH, CLOSE = b"E", b"F", b"C"


def read_exact(stream: Any, n: int) -> bytes:
    """``n`` bytes from ``stream``, or fewer where it ended first."""
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data
