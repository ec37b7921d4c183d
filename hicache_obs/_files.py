"""Files the project writes are never world-writable, whatever the umask.

- :func:`make_dirs`: create a folder and its missing parents with mode 0o755
- :func:`write_text` / :func:`write_bytes`: write an output file: a new or regular file
  atomically (temp file, then rename) with mode 0o644; a symlink written through; a FIFO,
  a character device or ``/dev/stdout`` written in place, never replaced; a folder, a
  block device or a socket refused
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import HiCacheError

__all__ = ["make_dirs", "write_text", "write_bytes", "check_output", "OutputPathError", "FILE_MODE", "DIR_MODE"]

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
    """Write ``text`` to ``path`` (UTF-8); what ``path`` already is decides how:

    - nothing: a new file, written atomically (a temp file beside it, then a rename),
      with ``mode`` (never world-writable, whatever the umask);
    - a regular file: replaced atomically the same way;
    - a symlink to a regular file: written through, the link kept: the file it points to
      is replaced atomically; a dangling symlink is refused;
    - ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``: written to that
      open descriptor of this process in place (a pipe, a terminal, a redirected file,
      ``>>`` included);
    - a FIFO or a character device (``/dev/null``, a terminal): opened and written in
      place, never replaced or removed;
    - a folder, a block device, a socket: refused.

    Refusals raise :class:`OutputPathError` (an ``OSError``) naming the path and what it is.
    """
    write_bytes(path, text.encode("utf-8"), mode)


def write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = FILE_MODE) -> None:
    """:func:`write_text` for bytes."""
    how, where = _plan(Path(path))
    if how == "fd":
        _write_to_fd(os.dup(int(where)), data)
    elif how in ("in place", "truncate"):
        flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC  # a FIFO waits for its reader here
        _write_to_fd(os.open(str(where), flags | (os.O_TRUNC if how == "truncate" else 0)), data)
    else:
        _replace_atomically(Path(str(where)), data, mode)


def check_output(path: str | os.PathLike[str]) -> None:
    """Raise :class:`OutputPathError` now if :func:`write_text` would refuse ``path``
    (so a command can refuse before it does its work)."""
    _plan(Path(path))


def _plan(target: Path) -> tuple[str, str | int]:
    """How :func:`write_bytes` writes ``target``: ``("fd", N)``, ``("in place", path)``,
    ``("truncate", path)`` or ``("replace", path)``; raises for what it refuses."""
    fd_no = _own_descriptor(target)
    if fd_no is not None:
        return "fd", fd_no
    try:
        st = os.stat(target)  # follows symlinks: what a write would reach
    except FileNotFoundError:
        if os.path.lexists(target):
            raise OutputPathError(
                f"cannot write {target}: it is a symlink to {os.readlink(target)}, which does not exist"
            ) from None
        return "replace", str(target)
    kind = st.st_mode
    if stat.S_ISREG(kind):
        if not target.is_symlink():
            return "replace", str(target)
        real = Path(os.path.realpath(target))
        try:
            rst = os.stat(real)
        except OSError:
            rst = None
        if rst is None or (rst.st_dev, rst.st_ino) != (st.st_dev, st.st_ino):
            return "truncate", str(target)  # a link no path names (a deleted file behind /proc/PID/fd)
        return "replace", str(real)
    if stat.S_ISFIFO(kind) or stat.S_ISCHR(kind):
        return "in place", str(target)
    raise OutputPathError(f"cannot write {target}: it is {_kind_name(kind)}, not a file")


class OutputPathError(HiCacheError, OSError):
    """An output path that cannot be written as a file (a folder, a socket, a dangling link...)."""


def _kind_name(st_mode: int) -> str:
    if stat.S_ISDIR(st_mode):
        return "a folder"
    if stat.S_ISBLK(st_mode):
        return "a block device"
    if stat.S_ISSOCK(st_mode):
        return "a socket"
    return f"a special file (mode {st_mode:o})"  # pragma: no cover - every kind is named above


_OWN_FD = re.compile(r"/(?:dev/fd|proc/self/fd)/(\d+)")


def _own_descriptor(target: Path) -> int | None:
    """The descriptor ``target`` names in this process (``/dev/stdout`` is 1), else None."""
    text = os.path.normpath(str(target))
    if text in ("/dev/stdout", "/dev/stderr"):
        return 1 if text == "/dev/stdout" else 2
    m = _OWN_FD.fullmatch(text)
    return int(m.group(1)) if m else None


def _write_to_fd(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` and close it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _replace_atomically(target: Path, data: bytes, mode: int) -> None:
    if target.parent != Path(""):
        make_dirs(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent if target.parent != Path("") else None, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, mode & 0o775)  # mkstemp makes 0600; keep group/other read, never other write
        _write_to_fd(fd, data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
