"""Probes (worker/probes.py): each runs on this machine and returns a value or None (unknown),
never raising; the CPU probe sees another process's load and not the worker's own."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from idlegrad.worker import probes
from idlegrad.worker.idle import Readings


def test_read_returns_readings_of_the_right_types():
    p = probes.Probes()
    time.sleep(0.2)
    r = p.read()
    assert isinstance(r, Readings)
    assert r.cpu_others_pct is None or 0.0 <= r.cpu_others_pct <= 100.0
    assert r.memory_available_mb is not None and r.memory_available_mb > 0  # psutil knows it here
    assert r.worker_rss_mb is not None and r.worker_rss_mb > 10
    assert r.on_battery in (None, True, False)
    assert r.user_idle_s is None or r.user_idle_s >= 0
    assert r.gpu_others_pct is None  # no GPU asked for
    assert 0 <= r.local_minute < 24 * 60
    assert isinstance(p.describe(), str)


@pytest.mark.parametrize("name", ["memory_available_mb", "on_battery", "logind_idle_s",
                                  "macos_idle_s", "windows_idle_s"])
def test_each_function_probe_runs_without_raising(name):
    value = probes._safe(getattr(probes, name))
    assert value is None or isinstance(value, (bool, float, int))
    getattr(probes, name)()  # called bare too: the platform checks themselves do not raise


def test_logind_probe_does_not_raise_and_is_none_or_a_duration():
    value = probes.logind_idle_s()
    assert value is None or value >= 0


def test_x11_without_display_is_unknown(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    assert probes.X11Idle().read() is None


def test_x11_with_a_display_that_is_not_there_is_unknown(monkeypatch):
    monkeypatch.setenv("DISPLAY", ":97")
    assert probes.X11Idle().read() is None


def test_user_idle_is_none_or_non_negative():
    u = probes.UserIdle()
    value = u.read()
    assert value is None or value >= 0
    assert isinstance(u.available(), list)


def test_gpu_probe_is_unknown_or_a_percentage():
    value = probes.GpuOthers(0).read()
    assert value is None or 0 <= value <= 100


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


def test_cpu_others_excludes_the_workers_own_tree_and_sees_everyone_else():
    """Two probes over the same window, so other load on a shared machine cancels out: one takes
    the hog as "its own" tree, the other as someone else's."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    # (not this process: the hog is our child, so our own tree includes it)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        hog_proc = probes.psutil.Process(hog.pid)
        # (ignore_niced=False: the same answer whether or not this test process is niced)
        mine = probes.CpuOthers(pid=hog.pid, ignore_niced=False)
        theirs = probes.CpuOthers(pid=bystander.pid, ignore_niced=False)
        ours = probes.CpuOthers(ignore_niced=False)
        t0, c0 = time.monotonic(), sum(hog_proc.cpu_times()[:2])
        time.sleep(1.0)
        excluded, counted, tree = mine.read(), theirs.read(), ours.read()
        hog_cpu = sum(hog_proc.cpu_times()[:2]) - c0
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
        time.sleep(0.4)
        hog_proc = probes.psutil.Process(hog.pid)
        ignoring.read(), counting.read()
        t0, c0 = time.monotonic(), sum(hog_proc.cpu_times()[:2])
        time.sleep(0.8)
        ign, cnt = ignoring.read(), counting.read()
        hog_pct = 100.0 * (sum(hog_proc.cpu_times()[:2]) - c0) / (
            (time.monotonic() - t0) * probes.psutil.cpu_count())
    finally:
        for p in (hog, *request_cleanup):
            p.kill()
            p.wait(timeout=10)
    if hog_pct < 2:
        pytest.skip(f"the niced hog got {hog_pct:.1f}% of the machine: too busy to tell")
    assert cnt - ign >= 0.5 * hog_pct, (ign, cnt, hog_pct)
    assert os.nice(0) >= 0
