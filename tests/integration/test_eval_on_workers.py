"""Evaluation as tasks (`--eval-on workers`), end to end: a real coordinator hands ranges of the
test set to real workers and combines their sums; the coordinator evaluates nothing itself
during the run. (An evaluation surviving the death of a worker holding one of its slots, and
this run's rules, are checked on the in-memory pair: tests/unit/test_eval_on_workers.py.)"""

from __future__ import annotations

import pytest

# the rules a run evaluated on workers keeps, as the in-memory pair's tests check them (tests/ is
# on the path: the unit and integration packages are its top-level ones)
from unit.test_eval_on_workers import check_evaluated_on_workers

from .harness import DEADLINE, read_metrics

pytestmark = pytest.mark.integration


def test_workers_evaluate_and_the_coordinator_does_not(cluster, digits_train_size):
    metrics = cluster.dir / "metrics.jsonl"
    coordinator, workers = cluster.start_together(
        ["--job", "digits", "--epochs", "20", "--eval-on", "workers", "--eval-every", "0.2",
         "--metrics", str(metrics)], ["w1", "w2"])
    assert coordinator.wait(DEADLINE) == 0, cluster.report()
    for proc in workers:
        assert proc.wait(DEADLINE) == 0, cluster.report()
    check_evaluated_on_workers(read_metrics(metrics), 20 * digits_train_size)
    cluster.assert_no_tracebacks()

