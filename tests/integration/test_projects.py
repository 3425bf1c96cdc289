"""Several projects per worker: two real coordinators and one real worker on loopback, the
worker's [[project]]s at shares 3:1. Both coordinators receive results (the compute-seconds each
one's status shows for the worker grow); when one coordinator stops, the other still gets the
worker's time, and the worker keeps going. How the time is split by share is measured in virtual
time on the in-memory pair (tests/unit/test_project_shares.py), where no load can move it."""

from __future__ import annotations

import pytest

from idlegrad.cli.processes import free_port, stop

from .harness import COORDINATOR_DEFAULTS, WORKER_DEFAULTS, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

JOB = ("--job", "digits", "--epochs", "100000")
# Tasks sleep 20 times their compute (counted as compute): the worker is busy all the time (its
# sessions contend for its one compute slot) without loading the shared cores the tests run on.
SLOWDOWN = ("--slowdown", "20")


def row(status, worker="shared") -> dict:
    snap = status.wait_for(lambda s: any(w["id"] == worker and w["done"] for w in s["workers"]),
                           f"{worker} computing")
    return next(w for w in snap["workers"] if w["id"] == worker)


def test_one_worker_serves_two_coordinators_and_the_one_left_when_the_other_stops(cluster):
    address = {"a": cluster.address, "b": f"tcp://127.0.0.1:{free_port()}"}
    config = cluster.dir / "worker.toml"
    config.write_text(f'[[project]]\nname = "a"\ncoordinator = "{address["a"]}"\nshare = 3\n'
                      f'[[project]]\nname = "b"\ncoordinator = "{address["b"]}"\nshare = 1\n')
    coordinators = {"a": cluster.coordinator(*JOB, name="coordinator-a"),
                    "b": cluster.spawn("coordinator-b", "coordinator", "--bind", address["b"],
                                       *COORDINATOR_DEFAULTS, *JOB)}
    worker = cluster.spawn("worker", "worker", "--config", str(config), "--id", "shared",
                           *WORKER_DEFAULTS, *SLOWDOWN)
    status = {name: cluster.status(address[name]) for name in address}
    for name in address:
        row(status[name])  # joined both, computing for both
    before = {name: row(status[name])["compute_s"] for name in address}
    for name in address:  # both keep receiving results: the worker does not serve one alone
        status[name].wait_for(lambda s: any(w["id"] == "shared" and w["compute_s"] > before[name]
                                            for w in s["workers"]),
                              f"{name}'s results", alive=[worker, coordinators[name]])

    stop([coordinators["b"].popen], grace=5.0)  # b goes down: a still gets the worker
    start_a = row(status["a"])["compute_s"]
    status["a"].wait_for(lambda s: any(w["id"] == "shared" and w["compute_s"] >= start_a + 2.0
                                       for w in s["workers"]),
                         "a's results after b stopped", alive=[worker, coordinators["a"]])
    # said once its session with b timed out
    until(lambda: "lost the coordinator" in worker.output(), "the worker saying b is lost", 60)
    assert worker.running() and coordinators["a"].running()
    cluster.assert_no_tracebacks()
