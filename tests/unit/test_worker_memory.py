"""A coordinator chooses a job's arguments, and so its size: a worker refuses, in one line, a job
its owner's memory limits have no room for, before allocating it where it can measure it first.

The caps here are this test process's own resident memory plus a little, so that the jobs that
must be refused are a few hundred MB at most: enough to tell, small enough to build if a
regression lets them through.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from idlegrad.common import protocol as proto
from idlegrad.common.errors import Refused
from idlegrad.common.job import build, load_job, model_bytes
from idlegrad.worker import allocator
from idlegrad.worker.daemon import Worker, WorkerConfig
from idlegrad.worker.idle import PolicyConfig, memory_left_mb

MiB = 2**20


def rss_mb() -> float:
    # What the tests before freed, this process keeps (a Worker keeps freed memory: allocator.py),
    # and a data set built into it would not grow the resident memory the cap is measured by.
    allocator.return_freed_memory()
    return psutil.Process().memory_info().rss / MiB


def worker(cap_mb: float) -> Worker:
    policy = PolicyConfig(worker_rss_max_mb=cap_mb)
    return Worker(WorkerConfig(device="cpu", credits=1, threads=torch.get_num_threads(),
                               policy=policy))


def welcome(job_args: dict, fingerprint: str = "0" * 16) -> proto.Welcome:
    msg = proto.Welcome(job="synthetic", job_args=job_args, fingerprint=fingerprint, seed=0,
                        heartbeat_s=1.0, liveness=3)
    return proto.decode(proto.encode(msg))  # as it arrives


def test_memory_left_is_the_tighter_of_the_cap_and_the_free_memory():
    capped = PolicyConfig(worker_rss_max_mb=1000, memory_available_min_mb=256)
    assert memory_left_mb(capped, worker_rss_mb=400, available_mb=8000) == 600
    assert memory_left_mb(capped, worker_rss_mb=400, available_mb=500) == 244
    assert memory_left_mb(capped, worker_rss_mb=1200, available_mb=8000) == -200
    uncapped = PolicyConfig(worker_rss_max_mb=None, memory_available_min_mb=None)
    assert memory_left_mb(uncapped, worker_rss_mb=400, available_mb=8000) == 8000


def test_a_model_is_measured_without_being_allocated():
    before = rss_mb()
    size = model_bytes(load_job("synthetic", {"params": 10**9}))  # 4 GB of float32
    assert size == pytest.approx(4e9, rel=0.01)
    assert rss_mb() - before < 50


def test_a_model_past_the_cap_is_refused_before_it_is_built():
    cap = rss_mb() + 100
    w = worker(cap)
    before = rss_mb()
    with pytest.raises(Refused, match=r"needs [\d,]+ MiB more .* --memory-max"):
        w._prepare(welcome({"params": 50_000_000}))  # 200 MB a copy
    assert rss_mb() - before < 50, "the model was allocated before it was refused"
    assert w.built is None and w.engine is None


def test_data_past_the_cap_is_refused_once_built():
    # A small model and a large data set: only building tells how much the data takes.
    w = worker(rss_mb() + 60)
    with pytest.raises(Refused, match=r"once built, needs .* --memory-max"):
        w._prepare(welcome({"params": 1000, "samples": 300_000, "features": 64}))
    assert w.built is None and w.engine is None


def test_a_job_within_the_cap_is_built():
    args = {"params": 2000, "samples": 512}
    fingerprint = build(load_job("synthetic", args)).fingerprint
    w = worker(rss_mb() + 200)
    w._prepare(welcome(args, fingerprint))
    assert w.built is not None and w.built.fingerprint == fingerprint and w.engine is not None
