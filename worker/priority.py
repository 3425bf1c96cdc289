"""Lowest CPU and IO priority for the worker process (no torch: call it before torch starts threads).

On Linux the nice value is a property of each thread, and new threads inherit their creator's, so
this must run in the main thread before torch, ZeroMQ or asyncio start theirs: the CLI does it first
thing. The service units ask the same of the OS (Nice=19, CPUSchedulingPolicy=idle,
IOSchedulingClass=idle), so the worker is low priority whichever way it is started.
"""

from __future__ import annotations

import logging
import os
import sys

import psutil

log = logging.getLogger("idlegrad.worker")


def lower_priority() -> list[str]:
    """Nice 19 (idle priority class on Windows) and the idle IO class where the OS has one.
    Returns what was done; a refusal is logged, never raised."""
    done = []
    proc = psutil.Process()
    try:
        if sys.platform == "win32":
            proc.nice(psutil.IDLE_PRIORITY_CLASS)
            done.append("idle priority class")
        else:
            proc.nice(19)
            done.append("nice 19")
    except (psutil.Error, OSError) as exc:
        log.warning("could not lower the CPU priority: %s", exc)
    try:
        if sys.platform.startswith("linux"):
            proc.ionice(psutil.IOPRIO_CLASS_IDLE)
            done.append("idle IO class")
        elif sys.platform == "win32":
            proc.ionice(psutil.IOPRIO_VERYLOW)
            done.append("very low IO priority")
    except (psutil.Error, OSError, AttributeError) as exc:
        log.warning("could not lower the IO priority: %s", exc)
    return done


def current_priority() -> str:
    proc = psutil.Process()
    try:
        nice = proc.nice()
    except (psutil.Error, OSError):
        nice = "?"
    try:
        io = proc.ionice() if hasattr(proc, "ionice") else None
    except (psutil.Error, OSError):
        io = None
    return f"nice {nice}" + (f", IO class {getattr(io, 'ioclass', io)}" if io is not None else "")


if __name__ == "__main__":  # pragma: no cover
    print(lower_priority(), current_priority(), os.getpid())
