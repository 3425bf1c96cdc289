"""Probes (worker/probes.py): each runs on this machine and returns a value or None (unknown),
never raising; the CPU probe sees another process's load and not the worker's own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from idlegrad.worker import probes
from idlegrad.worker.idle import Readings


def until(condition, timeout: float = 10.0, every: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(every)
    return True


def test_read_returns_readings_of_the_right_types():
    p = probes.Probes()
    readings = []
    # the CPU reading needs the clock to have ticked since the last: read until it has
    assert until(lambda: readings.append(p.read()) or readings[-1].cpu_others_pct is not None)
    r = readings[-1]
    assert isinstance(r, Readings)
    assert 0.0 <= r.cpu_others_pct <= 100.0  # psutil knows the CPU times here
    assert r.memory_available_mb is not None and r.memory_available_mb > 0  # psutil knows it here
    assert r.worker_rss_mb is not None and r.worker_rss_mb > 10
    assert r.on_battery in (None, True, False)
    assert r.user_idle_s is None or r.user_idle_s >= 0  # this machine may have no source: below
    assert r.gpu_others_pct is None  # no GPU asked for
    assert 0 <= r.local_minute < 24 * 60
    assert isinstance(p.describe(), str)


@pytest.mark.parametrize("name", ["memory_available_mb", "on_battery", "logind_idle_s",
                                  "macos_idle_s", "windows_idle_s"])
def test_each_function_probe_runs_without_raising(name):
    value = probes._safe(getattr(probes, name))
    assert value is None or isinstance(value, (bool, float, int))
    getattr(probes, name)()  # called bare too: the platform checks themselves do not raise


# each probe against a source whose answer is known ---------------------------------------------


def test_memory_is_psutils_available_bytes_in_mib(monkeypatch):
    monkeypatch.setattr(probes.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=3 * 2**30))
    assert probes.memory_available_mb() == 3 * 1024


@pytest.mark.parametrize("battery, no_battery_listed, expected", [
    (SimpleNamespace(power_plugged=False), False, True),
    (SimpleNamespace(power_plugged=True), False, False),
    (SimpleNamespace(power_plugged=None), False, None),  # a battery that cannot tell
    (None, True, False),  # no battery at all: on mains
    (None, False, None),  # psutil knows no battery, the system lists one: cannot tell
])
def test_on_battery(monkeypatch, battery, no_battery_listed, expected):
    monkeypatch.setattr(probes.psutil, "sensors_battery", lambda: battery, raising=False)
    monkeypatch.setattr(probes, "_linux_has_no_battery", lambda: no_battery_listed)
    assert probes.on_battery() is expected


NOW = 1_700_000_000.0


def fake_loginctl(monkeypatch, sessions: dict, listed_rc: int = 0, boot_age_s: float = 500.0):
    """loginctl answering for `sessions` (id -> properties), at time NOW."""
    monkeypatch.setattr(probes.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(probes.time, "time", lambda: NOW)
    monkeypatch.setattr(probes.psutil, "boot_time", lambda: NOW - boot_age_s)

    def run(args, **kwargs):
        if args[1] == "list-sessions":
            out = "".join(f"{sid} 1000 someone seat0 tty2\n" for sid in sessions)
            return subprocess.CompletedProcess(args, listed_rc, out, "")
        asked = [a for a in args[2:] if a in sessions]
        out = "\n\n".join("\n".join(f"{k}={v}" for k, v in sessions[sid].items()) for sid in asked)
        return subprocess.CompletedProcess(args, 0, out + "\n", "")
    monkeypatch.setattr(probes.subprocess, "run", run)


def since(seconds_ago: float) -> int:
    return int((NOW - seconds_ago) * 1e6)  # logind's microseconds


@pytest.mark.parametrize("sessions, expected", [
    ({"1": {"Class": "user", "Type": "x11", "IdleHint": "yes", "IdleSinceHint": since(30)}}, 30),
    # a greeter's activity is nobody's
    ({"1": {"Class": "user", "Type": "x11", "IdleHint": "yes", "IdleSinceHint": since(30)},
      "c1": {"Class": "greeter", "Type": "x11", "IdleHint": "no", "IdleSinceHint": 0}}, 30),
    # a tty's last input counts though logind does not call it idle; the least wins
    ({"2": {"Class": "user", "Type": "tty", "IdleHint": "no", "IdleSinceHint": since(50)},
      "3": {"Class": "user", "Type": "wayland", "IdleHint": "yes",
            "IdleSinceHint": since(80)}}, 50),
    # a desktop that says it is not idle: someone is at it
    ({"1": {"Class": "user", "Type": "wayland", "IdleHint": "no", "IdleSinceHint": since(99)},
      "2": {"Class": "user", "Type": "tty", "IdleHint": "no", "IdleSinceHint": since(50)}}, 0),
    ({}, 500),  # nobody logged in: idle since boot
])
def test_logind_idle_is_the_least_over_user_sessions(monkeypatch, sessions, expected):
    fake_loginctl(monkeypatch, sessions)
    assert probes.logind_idle_s() == pytest.approx(expected, abs=1e-3)


def test_logind_unreachable_or_missing_is_unknown(monkeypatch):
    fake_loginctl(monkeypatch, {"1": {"Class": "user", "IdleHint": "yes"}}, listed_rc=1)
    assert probes.logind_idle_s() is None
    monkeypatch.setattr(probes.shutil, "which", lambda name: None)
    assert probes.logind_idle_s() is None


def test_user_idle_is_the_least_of_the_sources_that_answer():
    u = probes.UserIdle()

    def broken():
        raise OSError("gone")
    u.sources = [("x11", lambda: None), ("logind", lambda: 40.0), ("macos", broken),
                 ("windows", lambda: 7.5)]
    assert u.read() == 7.5
    assert u.available() == ["logind", "windows"]
    u.sources = [("x11", lambda: None), ("macos", broken)]
    assert u.read() is None and u.available() == []


def test_user_idle_on_this_machine_is_unknown_or_a_duration():
    """Smoke only (this machine may have no source): the logic is tested above on fakes."""
    u = probes.UserIdle()
    value = u.read()
    assert value is None or value >= 0
    assert isinstance(u.available(), list)


class FakeNvml:
    """The calls of nvidia-ml-py that GpuOthers makes, answering with `samples`
    ((pid, smUtil, timeStamp) each; None: per-process figures not supported)."""

    class NVMLError(Exception):
        pass

    def __init__(self, samples, whole_gpu=55):
        self.samples, self.whole_gpu, self.asked_since = samples, whole_gpu, []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetProcessUtilization(self, handle, last_seen):
        self.asked_since.append(last_seen)
        if self.samples is None:
            raise self.NVMLError("not supported")
        return [SimpleNamespace(pid=pid, smUtil=util, timeStamp=stamp)
                for pid, util, stamp in self.samples]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.whole_gpu)


def test_gpu_others_leaves_out_the_workers_own_use(monkeypatch):
    nvml = FakeNvml([(111, 30, 5), (222, 25, 7), (111, 10, 9), (os.getpid(), 90, 8)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpu = probes.GpuOthers(0)
    assert gpu.read() == 35.0  # pid 111's latest sample (10) and 222's (25); ours left out
    gpu.read()
    assert nvml.asked_since == [0, 9]  # the next read asks only for newer samples
    nvml.samples = [(111, 80, 12), (222, 70, 12)]
    assert gpu.read() == 100.0  # a percentage


def test_gpu_without_per_process_figures_reads_the_whole_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(None, whole_gpu=55))
    assert probes.GpuOthers(0).read() == 55.0


def test_gpu_without_nvml_is_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the import fails
    assert probes.GpuOthers(0).read() is None


def test_x11_without_display_is_unknown(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    assert probes.X11Idle().read() is None


def test_x11_with_a_display_that_is_not_there_is_unknown(monkeypatch):
    monkeypatch.setenv("DISPLAY", ":97")
    assert probes.X11Idle().read() is None


def test_a_probe_that_raises_reads_unknown(monkeypatch):
    def boom():
        raise OSError("no such thing")
    monkeypatch.setattr(probes.psutil, "virtual_memory", boom)
    monkeypatch.setattr(probes.psutil, "sensors_battery", boom)
    assert probes.memory_available_mb() is None
    assert probes.on_battery() is None
    monkeypatch.setattr(probes.psutil, "cpu_times", boom)
    cpu = probes.CpuOthers()
    assert cpu.read() is None


def test_cached_source_waits_to_retry_a_missing_source():
    calls = []

    def missing():
        calls.append(1)
        return None
    cached = probes._Cached(missing, every=0.0, retry=60.0)
    assert cached() is None and cached() is None
    assert len(calls) == 1


def cpu_s(proc) -> float:
    return sum(proc.cpu_times()[:2])


def test_cpu_others_excludes_the_workers_own_tree_and_sees_everyone_else():
    """Two probes over the same window, so other load on a shared machine cancels out: one takes
    the hog as "its own" tree, the other as someone else's."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    # (not this process: the hog is our child, so our own tree includes it)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hog_proc = probes.psutil.Process(hog.pid)
        assert until(lambda: cpu_s(hog_proc) > 0.05), "the hog never ran"
        # (ignore_niced=False: the same answer whether or not this test process is niced)
        mine = probes.CpuOthers(pid=hog.pid, ignore_niced=False)
        theirs = probes.CpuOthers(pid=bystander.pid, ignore_niced=False)
        ours = probes.CpuOthers(ignore_niced=False)
        t0, c0 = time.monotonic(), cpu_s(hog_proc)
        until(lambda: cpu_s(hog_proc) - c0 >= 0.5)  # a window in which the hog got enough CPU
        excluded, counted, tree = mine.read(), theirs.read(), ours.read()
        hog_cpu = cpu_s(hog_proc) - c0
        window = time.monotonic() - t0
    finally:
        for p in (hog, bystander):
            p.kill()
            p.wait(timeout=10)
    assert excluded is not None and counted is not None and tree is not None
    # What the hog really got (a shared machine may starve it): the probes must differ by that.
    hog_pct = 100.0 * hog_cpu / (window * probes.psutil.cpu_count())
    assert hog_pct > 2, f"the hog got no CPU ({hog_pct:.1f}%): cannot tell"
    assert counted - excluded >= 0.5 * hog_pct, (excluded, counted, hog_pct)
    assert counted - tree >= 0.5 * hog_pct, (tree, counted, hog_pct)  # our children are ours


def test_niced_processes_are_ignored_by_default():
    import os
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ignoring = probes.CpuOthers(pid=bystander.pid, ignore_niced=True)
    counting = probes.CpuOthers(pid=bystander.pid, ignore_niced=False)
    hog = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    request_cleanup = [bystander]
    try:
        hog_proc = probes.psutil.Process(hog.pid)
        assert until(lambda: hog_proc.nice() == 19 and cpu_s(hog_proc) > 0.05), "no niced hog"
        ignoring.read(), counting.read()
        t0, c0 = time.monotonic(), cpu_s(hog_proc)
        until(lambda: cpu_s(hog_proc) - c0 >= 0.4)
        ign, cnt = ignoring.read(), counting.read()
        hog_pct = 100.0 * (cpu_s(hog_proc) - c0) / (
            (time.monotonic() - t0) * probes.psutil.cpu_count())
    finally:
        for p in (hog, *request_cleanup):
            p.kill()
            p.wait(timeout=10)
    if hog_pct < 2:
        pytest.skip(f"the niced hog got {hog_pct:.1f}% of the machine: too busy to tell")
    assert cnt - ign >= 0.5 * hog_pct, (ign, cnt, hog_pct)
    assert os.nice(0) >= 0
