"""What a peer names, used as text: a welcome's job arguments that name paths on the worker's
machine (worker/building.py, common/job_loading.py), and ids and reasons with newlines and
terminal escapes in them, which would forge log lines (common/text.py, coordinator/training.py's
events, the worker's session)."""

from __future__ import annotations

import logging

import pytest

from idlegrad.common import builtin_jobs
from idlegrad.common import protocol as proto
from idlegrad.common.errors import Refused
from idlegrad.common.job_loading import local_path_args, names_a_path, welcome_args
from idlegrad.coordinator.server import CoordinatorConfig
from idlegrad.worker.building import load_welcomed

from .pair import Pair

FORGED = "w1\n2026-12-02 10:00:00 INFO idlegrad.coordinator: ban: \x1b[2Kworker w2 banned"


def welcome(job: str, **job_args) -> proto.Welcome:
    return proto.Welcome(job=job, job_args=job_args, fingerprint="f" * 16, seed=0,
                         heartbeat_s=1.0, liveness=3)


@pytest.mark.parametrize("path", ["/home/owner/.ssh", "~/secrets", "./here", "../up", "a/b", "."])
def test_a_welcome_naming_a_local_path_is_refused_before_the_job_is_made(monkeypatch, path):
    read: list = []
    monkeypatch.setattr(builtin_jobs, "packed_corpus", lambda *a, **k: read.append(a) or "")
    monkeypatch.setattr(builtin_jobs, "read_cifar_batches", lambda *a: read.append(a))
    for job, args in (("lm", {"corpus": path, "size": "tiny"}), ("resnet", {"data": path})):
        with pytest.raises(Refused, match="name paths on this machine") as caught:
            load_welcomed(None, welcome(job, **args))
        assert path in str(caught.value) and "\n" not in str(caught.value)
    assert read == []
    assert load_welcomed(None, welcome("digits", hidden=8)).name  # plain arguments: built


def test_what_names_a_path_and_what_a_packed_job_sends_its_workers():
    assert [names_a_path(v) for v in ("/x", "~", "a/b", "tiny", 3, "https://m/x", "1e-3")] == \
        [True, True, True, False, False, False, False]
    args = {"corpus": "/srv/text", "size": "tiny", "data": "a" * 64}
    assert local_path_args(args) == ["corpus"]
    assert welcome_args(args, trains_on_pack=True) == {"size": "tiny", "data": "a" * 64}
    assert welcome_args(args, trains_on_pack=False) == args  # and the worker refuses it


def test_ids_and_reasons_in_events_and_their_log_lines_are_one_line_without_escapes(caplog):
    pair = Pair(CoordinatorConfig(job="synthetic", job_args={"params": 10, "batch_size": 16},
                                  epochs=1))
    try:
        with caplog.at_level(logging.INFO, logger="idlegrad"):
            pair.coordinator.training.event("handback", f"worker {FORGED} handed back",
                                            worker=FORGED)
        event = pair.coordinator.training.events[-1]
        for text in (event["text"], event["worker"], *[r.getMessage() for r in caplog.records]):
            assert "\n" not in text and "\x1b" not in text, text
        assert "w1\ufffd2026-12-02" in event["text"] and event["worker"].startswith("w1\ufffd")
    finally:
        pair.close()


def test_a_coordinators_reason_is_one_line_in_the_workers_log(caplog):
    from idlegrad.worker import session as S

    session = S.Session(1, proto.Hello(worker_id="w1", host="h", cores=1, threads=1,
                                       device="cpu", memory_mb=1, versions={}))
    with caplog.at_level(logging.INFO, logger="idlegrad"):
        session.received(0.0, proto.Shutdown(reason=FORGED))
        refused = session.received(0.0, proto.Reject(code="banned", reason=FORGED))
    said = [r.getMessage() for r in caplog.records] + [session.stopped] + [
        e.reason for e in refused]
    assert len(said) == 3 and all("\n" not in s and "\x1b" not in s for s in said), said
