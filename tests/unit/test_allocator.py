"""The worker keeps the memory a slot frees for the next one (worker/allocator.py), and gives it
back when its owner returns. Measured in a fresh process each: the setting is process-wide, and
this test process may have had it set already by a Worker built in another test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from idlegrad.worker import allocator, guest
from idlegrad.worker.idle import Decision, PolicyConfig

pytestmark = pytest.mark.skipif(allocator._glibc() is None, reason="the C library is not glibc")

# A slot's pattern, 20 times: its activations, four blocks of 3 MB, allocated and written as the
# forward goes, and freed at its end. The page faults of the last 10 are counted (the first
# slots map the heap in, either way).
SLOTS = textwrap.dedent("""
    import ctypes, resource, sys
    from idlegrad.worker import allocator
    if sys.argv[1] == "keep":
        assert allocator.keep_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 3 << 20
    for i in range(20):
        if i == 10:
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(4)]
        for block in blocks:
            ctypes.memset(block, 1, size)
        for block in blocks:
            libc.free(block)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
""")


def faults_per_slot(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", SLOTS, mode], capture_output=True, text=True,
                         timeout=60, check=True)
    return int(out.stdout.strip()) / 10


def test_a_slot_reuses_the_memory_the_last_one_freed():
    pages = 4 * (3 << 20) // 4096
    assert faults_per_slot("default") > pages / 2  # glibc's defaults: mapped and faulted afresh
    assert faults_per_slot("keep") < pages / 20


def test_freed_memory_goes_back_to_the_kernel_when_the_owner_returns(monkeypatch):
    returned = []
    monkeypatch.setattr(allocator, "return_freed_memory", lambda: returned.append(True))

    config = SimpleNamespace(policy=PolicyConfig(), cpu_ignore_niced=False, state_log=None)
    host = guest.Guest(config, uses_gpu=False)
    decisions = iter([Decision(False, ("the owner typed",), True), Decision(True, (), True)])
    monkeypatch.setattr(host.policy, "decide", lambda readings, now: next(decisions))
    host.apply(None, 0.0)
    assert not host.running.is_set() and returned == [True]
    host.apply(None, 1.0)  # resuming returns nothing
    assert host.running.is_set() and returned == [True]
