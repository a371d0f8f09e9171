"""Horovod's settings (``HOROVOD_*`` environment variables): read in one place, once, by ``hvd.init()``.

:class:`Settings` holds what the engine honours; :meth:`Settings.from_environment`
parses and checks every variable, naming it, what was expected and what came.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings", "FUSION_THRESHOLD", "CYCLE_TIME", "STALL_CHECK_TIME"]

#: Horovod's default fusion threshold (bytes): 128 MiB.
FUSION_THRESHOLD = 128 << 20
#: Horovod's default cycle time (seconds): 1 ms.
CYCLE_TIME = 1e-3
#: Horovod's default stall warning (seconds).
STALL_CHECK_TIME = 60.0


@dataclass(frozen=True)
class Settings:
    """What the engine of ``mpi_gradreducer.horovod`` honours of Horovod's settings.

    Attributes:
        fusion_threshold: ``HOROVOD_FUSION_THRESHOLD``: the most bytes of one
            fusion buffer (0: every tensor is reduced alone).
        cycle_time: ``HOROVOD_CYCLE_TIME`` (milliseconds there, seconds here):
            how long the engine collects requests before it negotiates them
            (sooner when the caller waits for a handle).
        stall_check: ``HOROVOD_STALL_CHECK_TIME_SECONDS``: after how long the
            coordinator names the ranks that have not submitted a tensor; None
            with ``HOROVOD_STALL_CHECK_DISABLE=1``.
        stall_shutdown: ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``: after how
            long such a stall ends the job with an error on every rank; None
            (Horovod's 0): never.
    """

    fusion_threshold: int = FUSION_THRESHOLD
    cycle_time: float = CYCLE_TIME
    stall_check: float | None = STALL_CHECK_TIME
    stall_shutdown: float | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings that ``environ`` (default ``os.environ``) asks for.

        Raises:
            ValueError: a variable whose value is not a number of the kind it
                takes, naming the variable, what it takes and what came.
        """
        env = os.environ if environ is None else environ
        threshold = _number(env, "HOROVOD_FUSION_THRESHOLD", FUSION_THRESHOLD, integer=True)
        cycle = _number(env, "HOROVOD_CYCLE_TIME", CYCLE_TIME * 1e3) / 1e3
        check = _number(env, "HOROVOD_STALL_CHECK_TIME_SECONDS", STALL_CHECK_TIME)
        shutdown = _number(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0)
        disabled = _flag(env, "HOROVOD_STALL_CHECK_DISABLE")
        return cls(int(threshold), cycle, None if disabled or check == 0 else check, shutdown or None)


def _number(env: Mapping[str, str], name: str, default: float, integer: bool = False) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(int(text)) if integer else float(text)
    except ValueError:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise ValueError(f"{name}: expected {kind}, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}: expected a finite non-negative number, got {text!r}")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    text = env.get(name, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}: expected 0 or 1, got {text!r}")
