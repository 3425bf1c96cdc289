"""Small pieces both asyncio shells (coordinator server, worker daemon) share."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable


def on_stop_signals(handler: Callable[[int], None]) -> None:
    """Call `handler(signum)` on SIGINT and SIGTERM, inside the running loop.

    Where the platform cannot (Windows, a loop outside the main thread), the default handling
    stays: KeyboardInterrupt, which the CLI turns into a clean exit.
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, handler, sig)
        except (NotImplementedError, RuntimeError):
            pass


def on_reload_signal(handler: Callable[[], None]) -> None:
    """Call `handler()` on SIGHUP (re-read configuration), where the platform has one."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, handler)
    except (NotImplementedError, RuntimeError, AttributeError):
        pass
