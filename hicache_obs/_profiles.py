"""Instrumentation profiles: how much evidence an instrumented controller records.

- ``metrics``: what the dashboards read (operations and their outcomes, slots and bytes
  moved, durations, queue waits, operations in flight, pool occupancy, index moves, stream
  records, drops) and the op rules that need no slot values (``unrecorded_index`` among
  them), at one event per submission. No slot value is read and no allocation is observed.
- ``audit``: every event and every rule.
- ``sampling``: ``metrics``, and the full evidence of a share of the operations
  (``audit_sample``): their slot values, and a free of their device indices while they
  are in flight is a use after free.

docs/profiles.md lists what each rule needs and which profile keeps it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

__all__ = [
    "PROFILES",
    "DEFAULT_AUDIT_SAMPLE",
    "PROFILE_ENV",
    "AUDIT_SAMPLE_ENV",
    "Profile",
    "resolve_profile",
    "profile_from_env",
    "Sampler",
]

PROFILES = ("metrics", "audit", "sampling")
#: The share of operations ``sampling`` audits in full when none is given.
DEFAULT_AUDIT_SAMPLE = 0.01
PROFILE_ENV = "HICACHE_OBS_PROFILE"
AUDIT_SAMPLE_ENV = "HICACHE_OBS_AUDIT_SAMPLE"


@dataclass(frozen=True)
class Profile:
    """A resolved profile: its ``name`` and the share of operations audited in full
    (1 for ``audit``, 0 for ``metrics``)."""

    name: str
    audit_sample: float

    @property
    def full(self) -> bool:
        """Every event and every rule (``audit``)."""
        return self.name == "audit"


def _share(value: object, what: str) -> float:
    try:
        share = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number from 0 to 1, got {value!r}") from None
    if not math.isfinite(share) or not 0.0 <= share <= 1.0:
        raise ConfigError(f"{what} must be a number from 0 to 1, got {value!r}")
    return share


def resolve_profile(
    profile: str | Profile | None = None, audit_sample: float | None = None, *, default: str = "audit"
) -> Profile:
    """The :class:`Profile` for ``profile`` (default ``default``) and ``audit_sample``.

    ``metrics`` with a share above 0 is ``sampling``; ``sampling`` without one audits
    :data:`DEFAULT_AUDIT_SAMPLE` of the operations. :class:`~hicache_obs.errors.ConfigError`
    names the value for an unknown profile, a share outside [0, 1], a share given to
    ``audit`` (which audits every operation) or ``sampling`` at a share of 0."""
    if isinstance(profile, Profile):
        if audit_sample is not None:
            raise ConfigError("audit_sample: give it with a profile name, not with a resolved Profile")
        return profile
    name = default if profile is None else profile
    if name not in PROFILES:
        raise ConfigError(f"profile must be one of {', '.join(PROFILES)}; got {name!r}")
    share = None if audit_sample is None else _share(audit_sample, "audit_sample")
    if name == "audit":
        if share not in (None, 1.0):
            raise ConfigError(f"audit_sample {audit_sample!r}: the audit profile audits every operation; "
                              "use profile 'sampling' for a share")
        return Profile("audit", 1.0)
    if name == "metrics":
        return Profile("sampling", share) if share else Profile("metrics", 0.0)
    if share == 0.0:
        raise ConfigError("audit_sample 0: the sampling profile needs a share above 0 (or use profile 'metrics')")
    return Profile("sampling", DEFAULT_AUDIT_SAMPLE if share is None else share)


def profile_from_env(environ: Mapping[str, str] | None = None, *, default: str = "metrics") -> Profile:
    """The profile ``HICACHE_OBS_PROFILE`` and ``HICACHE_OBS_AUDIT_SAMPLE`` name (empty or unset:
    ``default``, no share); a bad value is a :class:`~hicache_obs.errors.ConfigError` naming
    the variable."""
    env = os.environ if environ is None else environ
    name = env.get(PROFILE_ENV) or None
    raw = env.get(AUDIT_SAMPLE_ENV) or None
    try:
        return resolve_profile(name, None if raw is None else _share(raw, AUDIT_SAMPLE_ENV), default=default)
    except ConfigError as exc:
        raise ConfigError(f"{PROFILE_ENV}={name or ''} {AUDIT_SAMPLE_ENV}={raw or ''}: {exc}") from None


class Sampler:
    """Picks ``share`` of the calls to :meth:`take`, evenly: the first, then one in every
    ``1/share`` (a share of 0.01 takes calls 1, 101, 201, ...). ``taken`` and ``seen`` count them."""

    __slots__ = ("_acc", "seen", "share", "taken")

    def __init__(self, share: float) -> None:
        self.share = _share(share, "share")
        self._acc = 1.0 - self.share if self.share else 0.0
        self.seen = 0
        self.taken = 0

    def take(self) -> bool:
        self.seen += 1
        if not self.share:
            return False
        acc = self._acc + self.share
        if acc >= 1.0 - 1e-9:
            self._acc = acc - 1.0
            self.taken += 1
            return True
        self._acc = acc
        return False
