"""The exception hierarchy: every misuse raises a subclass of :class:`HiCacheError`.

Expected failures (a full allocator, a transfer that failed on the device) are
values, not exceptions; these classes are for misuse and corrupt input. Each
message names what was wrong and with which value.
"""

from __future__ import annotations

__all__ = [
    "HiCacheError",
    "InvalidIndicesError",
    "LengthMismatchError",
    "SlotNotAllocatedError",
    "DoubleFreeError",
    "PageSizeError",
    "UnknownPoolError",
    "UnknownBackendError",
    "UnknownLayoutError",
    "UnresolvedTransferError",
    "IndexNotOnDeviceError",
    "RuntimeUnavailableError",
    "ControllerClosedError",
    "ProducerSlotBusyError",
    "SequenceError",
    "LogFormatError",
    "LogLimitError",
    "UnsupportedLogVersionError",
    "ConfigError",
    "IntegrationError",
]


class HiCacheError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A constructor or option got a value it cannot work with."""


class InvalidIndicesError(HiCacheError, ValueError):
    """An index tensor has the wrong type, dtype, rank, device or values."""


class LengthMismatchError(InvalidIndicesError):
    """Host and device index tensors of one transfer differ in length."""


class SlotNotAllocatedError(InvalidIndicesError):
    """An index names a slot that is out of range or not allocated."""


class DoubleFreeError(SlotNotAllocatedError):
    """A slot was freed that is already free."""


class PageSizeError(InvalidIndicesError):
    """A request is not a whole number of pages."""


class UnknownPoolError(HiCacheError, KeyError):
    """A pool name the controller does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownBackendError(HiCacheError, ValueError):
    """An io backend name that is not `kernel` or `direct`."""


class UnknownLayoutError(HiCacheError, ValueError):
    """A host layout name that is not supported by the backend."""


class UnresolvedTransferError(HiCacheError, ValueError):
    """A pool transfer reached submission with a side still None."""


class IndexNotOnDeviceError(InvalidIndicesError):
    """The kernel io backend was handed an index tensor that is not on the device."""


class RuntimeUnavailableError(HiCacheError, RuntimeError):
    """A runtime was asked for that this machine cannot provide (e.g. cuda without a GPU)."""


class ControllerClosedError(HiCacheError, RuntimeError):
    """An operation was called on a closed controller."""


class ProducerSlotBusyError(HiCacheError, RuntimeError):
    """LayerDoneCounter: a producer slot was reused before its previous load finished."""


class SequenceError(HiCacheError, ValueError):
    """An event log has a gap or a duplicate in its sequence numbers."""


class LogFormatError(HiCacheError, ValueError):
    """A log line is malformed; the message names the file and the line number."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.line = line


class IntegrationError(HiCacheError, TypeError):
    """An engine's controller cannot be instrumented: the message names what is missing."""


class LogLimitError(LogFormatError):
    """A log asks a reader for more than its documented limits (pools, total capacity):
    the message names the value and the limit."""


class UnsupportedLogVersionError(LogFormatError):
    """A log segment's header names a format version newer than this reader reads: the
    message names the file, the version found and the versions readable."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None, version: int) -> None:
        super().__init__(message, file=file, line=line)
        self.version = version
