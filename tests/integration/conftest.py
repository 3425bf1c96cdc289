"""Fixtures for the integration tests: real coordinator and worker processes on loopback.

`cluster` starts idlegrad processes (through `idlegrad.cli.processes.spawn`), each logging to its
own file under the test's tmp_path, and stops and reaps every one of them by PID in its finalizer
(`idlegrad.cli.processes.stop`: SIGTERM, bounded grace, SIGKILL), whatever the test did. When a
test fails, the tail of every process's log is attached to the failure report.
"""

from __future__ import annotations

import pytest

from .harness import Cluster

_CLUSTER = pytest.StashKey[Cluster]()


@pytest.fixture
def cluster(request, tmp_path) -> Cluster:
    c = Cluster(tmp_path)
    request.node.stash[_CLUSTER] = c
    request.addfinalizer(c.close)
    return c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("setup", "call"):
        c = item.stash.get(_CLUSTER, None)
        if c is not None and c.procs:
            report.sections.append(("idlegrad process logs", c.report()))


@pytest.fixture(scope="session")
def digits_train_size() -> int:
    """len(train) of the built-in digits job, as the coordinator builds it."""
    from idlegrad.common.builtin_jobs import digits
    from idlegrad.common.job import build

    return len(build(digits()).train)
