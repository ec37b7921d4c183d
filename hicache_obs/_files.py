"""Files the project writes are never world-writable, whatever the umask.

- :func:`make_dirs`: create a folder and its missing parents with mode 0o755
- :func:`write_text`: write a file atomically (temp file, then rename) with mode 0o644
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["make_dirs", "write_text", "FILE_MODE", "DIR_MODE"]

FILE_MODE = 0o644
DIR_MODE = 0o755


def make_dirs(path: str | os.PathLike[str], mode: int = DIR_MODE) -> Path:
    """Create ``path`` and missing parents, each with ``mode`` (umask can only remove bits)."""
    p = Path(path)
    missing = []
    cur = p
    while not cur.exists():
        missing.append(cur)
        if cur.parent == cur:
            break
        cur = cur.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)  # the umask can only take bits away: never world-writable
        except FileExistsError:
            continue
    return p


def write_text(path: str | os.PathLike[str], text: str, mode: int = FILE_MODE) -> None:
    """Write ``text`` to ``path`` atomically; the file is never world-writable."""
    target = Path(path)
    if target.parent != Path(""):
        make_dirs(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent if target.parent != Path("") else None, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, mode & 0o775)  # mkstemp makes 0600; keep group/other read, never other write
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
