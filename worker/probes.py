"""Probes: what the machine is doing, read with psutil and the platform's own interfaces.

Each probe returns a value or None ("unknown": the platform lacks it, or it failed this time) and
never raises; `Probes.read()` gathers them into an `idle.Readings` for the policy. Probes that start
a subprocess (logind's `loginctl`, macOS `ioreg`) are rate-limited and cached, and a source that is
missing here is retried only once a minute, so sampling twice a second costs next to nothing.
The daemon calls `read()` in a thread, so a slow probe never holds up its event loop.

| reading | source |
| --- | --- |
| CPU of others | `psutil.cpu_times()` deltas minus the worker's own process tree; by default CPU time of niced processes (nice > 0: background work by the owner's own declaration, other idlegrad workers among them) does not count |
| memory | `psutil.virtual_memory().available` |
| battery | `psutil.sensors_battery()`; on Linux a machine whose /sys/class/power_supply lists no battery is on mains |
| user activity | the least idle time of: X11's screensaver extension (`XScreenSaverQueryInfo`, when DISPLAY is set), logind's IdleHint/IdleSinceHint of every user session (`loginctl`), macOS `HIDIdleTime` (`ioreg`), Windows `GetLastInputInfo` |
| GPU of others | nvidia-ml-py (`pynvml`), when installed: per-process utilisation without the worker's own |
| worker RSS | the worker's own process tree |
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import psutil

from .idle import Readings

log = logging.getLogger("idlegrad.worker.probes")

RETRY_MISSING_S = 60.0  # a missing source (no loginctl, no X display) is looked for again this often


def _safe(fn: Callable, *args):
    try:
        return fn(*args)
    except Exception as exc:  # a probe never raises: unknown instead
        log.debug("probe %s failed: %s", getattr(fn, "__name__", fn), exc)
        return None


class _Cached:
    """Calls `fn` at most every `every` seconds; a None result (source missing) waits `retry`."""

    def __init__(self, fn: Callable[[], Optional[float]], every: float, retry: float = RETRY_MISSING_S):
        self.fn, self.every, self.retry = fn, every, retry
        self._value: Optional[float] = None
        self._at: Optional[float] = None
        self._next = 0.0

    def __call__(self) -> Optional[float]:
        now = time.monotonic()
        if now >= self._next:
            self._value = _safe(self.fn)
            self._at = now
            self._next = now + (self.every if self._value is not None else self.retry)
        if self._value is None or self._at is None:
            return None
        return self._value + (now - self._at)  # idle time grows while cached


# CPU ---------------------------------------------------------------------------------------------


class CpuOthers:
    """Percent of the whole machine (all cores = 100) used by processes outside the worker's tree,
    since the previous call. The first call after construction measures from construction."""

    CHILDREN_EVERY_S = 10.0

    def __init__(self, pid: Optional[int] = None, ignore_niced: bool = True):
        self.proc = psutil.Process(pid)
        self.ignore_niced = ignore_niced
        self._children: list[psutil.Process] = []
        self._children_at = -1e9
        self._last = _safe(self._sample)

    def _tree(self) -> list[psutil.Process]:
        now = time.monotonic()
        if now - self._children_at > self.CHILDREN_EVERY_S:
            self._children = _safe(self.proc.children, True) or []
            self._children_at = now
        return [self.proc, *self._children]

    def _sample(self) -> Optional[tuple]:
        t = psutil.cpu_times()
        guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # already in user/nice
        total = sum(t) - guest
        nice = getattr(t, "nice", 0.0)
        busy = total - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)
        own_user = own_system = 0.0
        for p in self._tree():
            try:
                c = p.cpu_times()
            except (psutil.Error, OSError):
                continue
            own_user += c.user
            own_system += c.system
        niced = (_safe(self.proc.nice) or 0) > 0 if os.name == "posix" else False
        return total, busy, nice, own_user, own_system, niced

    def read(self) -> Optional[float]:
        now = _safe(self._sample)
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        total = now[0] - last[0]
        if total <= 0:
            return None
        busy, nice = now[1] - last[1], now[2] - last[2]
        own_user, own_system = max(0.0, now[3] - last[3]), max(0.0, now[4] - last[4])
        if self.ignore_niced:
            # Our own user time sits in the `nice` bucket when we are niced, in `user` otherwise.
            others = busy - nice - own_system - (0.0 if now[5] else own_user)
        else:
            others = busy - own_user - own_system
        return min(100.0, max(0.0, 100.0 * others / total))


# memory, battery, RSS ----------------------------------------------------------------------------


def memory_available_mb() -> Optional[float]:
    return _safe(lambda: psutil.virtual_memory().available / 2**20)


def _linux_has_no_battery() -> bool:
    base = "/sys/class/power_supply"
    if not sys.platform.startswith("linux") or not os.path.isdir(base):
        return False
    for name in os.listdir(base):
        try:
            with open(os.path.join(base, name, "type")) as fh:
                if fh.read().strip().lower() == "battery":
                    return False
        except OSError:
            return False  # cannot tell
    return True


def on_battery() -> Optional[bool]:
    def probe():
        battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
        if battery is None:
            return False if _linux_has_no_battery() else None
        if battery.power_plugged is None:
            return None
        return not battery.power_plugged
    return _safe(probe)


class TreeRss:
    CHILDREN_EVERY_S = 10.0

    def __init__(self, pid: Optional[int] = None):
        self.proc = psutil.Process(pid)
        self._children: list[psutil.Process] = []
        self._children_at = -1e9

    def read(self) -> Optional[float]:
        def probe():
            now = time.monotonic()
            if now - self._children_at > self.CHILDREN_EVERY_S:
                self._children = self.proc.children(recursive=True)
                self._children_at = now
            total = self.proc.memory_info().rss
            for child in self._children:
                try:
                    total += child.memory_info().rss
                except (psutil.Error, OSError):
                    pass
            return total / 2**20
        return _safe(probe)


# user activity -----------------------------------------------------------------------------------


class X11Idle:
    """Milliseconds since the last input, from the X screensaver extension, through ctypes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._display = None
        self._lib = None

    def _open(self) -> bool:
        import ctypes
        import ctypes.util

        if not os.environ.get("DISPLAY"):
            return False
        x11 = ctypes.util.find_library("X11")
        xss = ctypes.util.find_library("Xss")
        if not x11 or not xss:
            return False
        x11, xss = ctypes.CDLL(x11), ctypes.CDLL(xss)

        class Info(ctypes.Structure):
            _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int),
                        ("kind", ctypes.c_int), ("til_or_since", ctypes.c_ulong),
                        ("idle", ctypes.c_ulong), ("eventMask", ctypes.c_ulong)]

        x11.XOpenDisplay.restype = ctypes.c_void_p
        x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
        x11.XDefaultRootWindow.restype = ctypes.c_ulong
        x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(Info)
        xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(Info)]
        xss.XScreenSaverQueryExtension.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        display = x11.XOpenDisplay(None)
        if not display:
            return False
        a, b = ctypes.c_int(), ctypes.c_int()
        if not xss.XScreenSaverQueryExtension(display, ctypes.byref(a), ctypes.byref(b)):
            x11.XCloseDisplay(ctypes.c_void_p(display))
            return False
        self._display = display
        self._lib = (x11, xss, xss.XScreenSaverAllocInfo())
        return True

    def read(self) -> Optional[float]:
        def probe():
            with self._lock:
                if self._display is None and not self._open():
                    return None
                x11, xss, info = self._lib
                if not xss.XScreenSaverQueryInfo(self._display, x11.XDefaultRootWindow(self._display),
                                                 info):
                    return None
                return info.contents.idle / 1000.0
        return _safe(probe)


def logind_idle_s() -> Optional[float]:
    """The least idle time over logind's user sessions (all users: whoever sits at the machine).
    No sessions at all: nobody is logged in, idle since boot. None: logind is not reachable."""
    loginctl = shutil.which("loginctl")
    if loginctl is None:
        return None
    run = lambda *args: subprocess.run(  # noqa: E731
        [loginctl, *args], capture_output=True, text=True, timeout=2.0, stdin=subprocess.DEVNULL)
    listed = run("list-sessions", "--no-legend", "--no-pager")
    if listed.returncode != 0:
        return None
    sessions = [line.split()[0] for line in listed.stdout.splitlines() if line.split()]
    now_us = time.time() * 1e6
    if not sessions:
        return max(0.0, time.time() - psutil.boot_time())
    shown = run("show-session", *sessions, "-p", "Class", "-p", "Type", "-p", "IdleHint",
                "-p", "IdleSinceHint", "--no-pager")
    if shown.returncode != 0:
        return None
    best: Optional[float] = None
    for block in shown.stdout.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Class", "user") != "user":
            continue  # greeters, lock screens, background sessions
        since = int(props.get("IdleSinceHint") or 0)
        if props.get("IdleHint") == "yes" and since > 0:
            idle = max(0.0, (now_us - since) / 1e6)
        elif props.get("Type") == "tty" and since > 0:
            idle = max(0.0, (now_us - since) / 1e6)  # logind tracks the tty's last input
        else:
            idle = 0.0  # a desktop that says it is not idle: someone is using it
        best = idle if best is None else min(best, idle)
    return best if best is not None else max(0.0, time.time() - psutil.boot_time())


def macos_idle_s() -> Optional[float]:
    if sys.platform != "darwin" or shutil.which("ioreg") is None:
        return None
    out = subprocess.run(["ioreg", "-c", "IOHIDSystem", "-d", "4"], capture_output=True, text=True,
                         timeout=2.0, stdin=subprocess.DEVNULL).stdout
    for line in out.splitlines():
        if '"HIDIdleTime"' in line:
            return int(line.rsplit("=", 1)[1].strip()) / 1e9
    return None


def windows_idle_s() -> Optional[float]:
    if sys.platform != "win32":
        return None
    import ctypes

    class LASTINPUTINFO(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LASTINPUTINFO()
    info.cbSize = ctypes.sizeof(info)
    if not ctypes.windll.user32.GetLastInputInfo(ctypes.byref(info)):
        return None
    ticks = ctypes.windll.kernel32.GetTickCount() & 0xFFFFFFFF
    return ((ticks - info.dwTime) & 0xFFFFFFFF) / 1000.0


class UserIdle:
    """Seconds since the last user input: the least over every source this machine has."""

    def __init__(self, every: float = 1.0):
        self.x11 = X11Idle()
        self.sources: list[tuple[str, Callable[[], Optional[float]]]] = [
            ("x11", _Cached(self.x11.read, every=0.0)),  # cheap: no subprocess
            ("logind", _Cached(logind_idle_s, every=every)),
            ("macos", _Cached(macos_idle_s, every=every)),
            ("windows", _Cached(windows_idle_s, every=0.0)),
        ]
        if not sys.platform.startswith("linux"):
            self.sources = [s for s in self.sources if s[0] not in ("logind",)]

    def read(self) -> Optional[float]:
        values = [v for _, source in self.sources if (v := _safe(source)) is not None]
        return min(values) if values else None

    def available(self) -> list[str]:
        return [name for name, source in self.sources if _safe(source) is not None]


# GPU ---------------------------------------------------------------------------------------------


class GpuOthers:
    """Percent utilisation of GPU `index` by processes other than the worker (nvidia-ml-py)."""

    def __init__(self, index: int = 0, pid: Optional[int] = None):
        self.index = index
        self.pid = pid or os.getpid()
        self._nvml = None
        self._handle = None
        self._last_seen = 0
        self._failed = False

    def _init(self) -> bool:
        if self._failed:
            return False
        try:
            import pynvml  # nvidia-ml-py, optional: pip install 'idlegrad[gpu]'
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            self._nvml = pynvml
            return True
        except Exception as exc:  # not installed, no driver, no device
            log.debug("no GPU probe: %s", exc)
            self._failed = True
            return False

    def read(self) -> Optional[float]:
        def probe():
            if self._nvml is None and not self._init():
                return None
            nvml, handle = self._nvml, self._handle
            try:
                samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._last_seen)
            except nvml.NVMLError:
                samples = None  # no samples yet, or not supported on this GPU
            if samples:
                self._last_seen = max(s.timeStamp for s in samples)
                latest: dict[int, int] = {}
                for s in samples:
                    latest[s.pid] = s.smUtil
                return float(min(100, sum(u for pid, u in latest.items() if pid != self.pid)))
            # No per-process figures: the whole GPU's use (ours included) is the best we have.
            return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        return _safe(probe)


# all of them -------------------------------------------------------------------------------------


class Probes:
    """All probes of this machine. `read()` takes a few milliseconds; call it from a thread."""

    def __init__(self, pid: Optional[int] = None, ignore_niced: bool = True,
                 gpu_index: Optional[int] = None, user_every: float = 1.0):
        self.cpu = CpuOthers(pid, ignore_niced=ignore_niced)
        self.rss = TreeRss(pid)
        self.user = UserIdle(every=user_every)
        self.gpu = GpuOthers(gpu_index, pid) if gpu_index is not None else None

    def restart(self) -> None:
        """Forget the CPU baseline: the next reading covers only the time from now."""
        self.cpu._last = _safe(self.cpu._sample)

    def read(self) -> Readings:
        now = time.localtime()
        return Readings(
            cpu_others_pct=self.cpu.read(),
            user_idle_s=self.user.read(),
            on_battery=on_battery(),
            memory_available_mb=memory_available_mb(),
            gpu_others_pct=self.gpu.read() if self.gpu is not None else None,
            worker_rss_mb=self.rss.read(),
            local_minute=now.tm_hour * 60 + now.tm_min,
        )

    def describe(self) -> str:
        """One line for the log: which sources this machine offers."""
        user = self.user.available()
        return (f"user activity from {', '.join(user) if user else 'nowhere (unknown)'}; "
                f"battery {'unknown' if on_battery() is None else 'known'}; "
                f"GPU {'probed' if self.gpu is not None and self.gpu.read() is not None else 'not probed'}")
