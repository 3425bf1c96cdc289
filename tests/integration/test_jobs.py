"""A job defined in a file outside the package; and workers that cannot run the coordinator's job."""

from __future__ import annotations

import textwrap

import pytest

from .harness import final_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

JOB_FILE = '''
"""A user's job: a small tanh MLP on the digits arrays, defined outside idlegrad."""

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from idlegrad.common.builtin_jobs import load_digits_arrays
from idlegrad.common.job import Job

HIDDEN = {hidden}


def _datasets():
    x, y = load_digits_arrays()
    order = np.random.RandomState(1).permutation(len(x))
    x = torch.from_numpy(x[order] / 16.0).float()
    y = torch.from_numpy(y[order])
    cut = 1400
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def make_job(lr=0.01):
    return Job(
        name="my-digits",
        build_model=lambda: nn.Sequential(nn.Linear(64, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 10)),
        build_datasets=_datasets,
        loss=_loss,
        build_optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        batch_size=32,
    )
'''


def write_job(directory, name: str, hidden: int):
    path = directory / name
    path.write_text(textwrap.dedent(JOB_FILE).replace("{hidden}", str(hidden)))
    return path


def test_file_job_trains_and_workers_without_it_are_refused(cluster):
    jobs = cluster.dir / "jobs"
    jobs.mkdir()
    spec = f"{write_job(jobs, 'myjob.py', hidden=32)}:make_job"
    # Same job name and factory, another model: a different fingerprint.
    other = f"{write_job(jobs, 'otherjob.py', hidden=48)}:make_job"
    ckpt = cluster.dir / "ckpt"
    coordinator = cluster.coordinator("--job", spec, "--job-arg", "lr=0.02", "--target",
                                      "accuracy=0.9", "--epochs", "100",
                                      "--checkpoint-dir", str(ckpt))
    status = cluster.status()
    status.wait_for(lambda s: True, "answer from the coordinator", alive=[coordinator])

    # Workers that cannot run this job: one has no --job, one has another model under that name.
    # They are started (and refused) before the good worker, so that training cannot end first.
    builtin_only = cluster.worker("builtin-only")
    mismatched = cluster.worker("mismatched", "--job", other)

    assert builtin_only.wait(timeout=60) != 0
    said = builtin_only.said()  # one line besides its log records
    assert len(said) == 1 and builtin_only.lines()[-1] == said[0], builtin_only.output()
    (line,) = said
    assert line.startswith("idlegrad worker: error:") and "not built in" in line and "--job" in line
    assert "Traceback" not in builtin_only.output()

    assert mismatched.wait(timeout=60) != 0
    out = mismatched.output()
    assert "Traceback" not in out
    line = mismatched.lines()[-1]
    assert line.startswith("idlegrad worker: error:")
    # what differs, in the worker's words: the first layer's shape, here and there
    assert "parameter 0.weight: [48, 64] float32 here, [32, 64] float32 at the coordinator" in line
    assert "joined" not in out  # it leaves before announcing credits, not after

    good = cluster.worker("good", "--job", spec)
    assert status.follow(coordinator) == 0
    assert good.wait(timeout=30) == 0
    assert "training finished (target)" in good.output()

    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "target" and final["metrics"]["accuracy"] >= 0.9
    assert status.first["job"] == "my-digits"
    refusals = {e["worker"]: e["text"] for e in status.events_of("refused")}
    # the coordinator says what differs too, not that the worker left without a word
    assert "parameter 0.weight: [32, 64] float32 here, [48, 64] float32 on the worker" in \
        refusals.get("mismatched", ""), refusals
    assert "parameter 0.weight" in coordinator.output()  # in its log
    assert "Traceback" not in coordinator.output() + good.output()
