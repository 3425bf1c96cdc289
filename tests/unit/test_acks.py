"""Acknowledgements (moved from the integration suite onto the in-memory pair, tests/unit/pair.py):
a task sent in answer to a result carries that result's acknowledgement (one message instead of
two); a result answered by no task is acknowledged on its own. A raw peer plays the worker, so
what is checked is each message the coordinator puts on the wire, as encoded there."""

from __future__ import annotations

import torch

from idlegrad.common import protocol as proto
from idlegrad.coordinator.effects import Compute
from idlegrad.coordinator.server import CoordinatorConfig
from idlegrad.coordinator.slots import SlotWork

from .pair import Pair

PARAMS = 100
RAW = b"raw"


def answer(pair: Pair, task: proto.Task, size: int) -> list:
    """An honest result for `task`, computed as a worker would (a made-up gradient would be
    suspected by the norm screen and computed again before its slot is settled)."""
    work = SlotWork(version=task.version, parts=task.parts, coefficients=task.coefficients)
    (computed,) = pair.coordinator.training.model.computation(Compute(slot=task.slot, work=work))()
    gradient = computed.detach().to(torch.float32).numpy().astype("<f4").tobytes()
    return proto.encode(proto.Result(
        slot=task.slot, version=task.version, samples=sum(p[2] for p in task.parts), loss=0.5,
        compute_s=0.01, gradient=proto.Blob("float32", size, (gradient,))))


def replies(pair: Pair, since: int) -> list:
    """The tasks and acks sent to the raw peer after the first `since` messages on the wire."""
    return [m for r, m in pair.wire.sent[since:] if r == RAW and isinstance(m, (proto.Task,
                                                                                  proto.Ack))]


def test_a_task_carries_the_ack_of_the_result_it_answers():
    pair = Pair(CoordinatorConfig(job="synthetic", job_args={"params": PARAMS, "batch_size": 16},
                                  partitions=2, epochs=50, eval_every=3600, heartbeat_s=0.5))
    size = pair.coordinator.training.model.model.numel
    pair.frames(proto.encode(proto.Hello(worker_id="raw", host="here", cores=1, threads=1,
                                         device="cpu", memory_mb=1, versions={})), RAW)
    (welcome,) = pair.wire.to(RAW, proto.Welcome)
    pair.frames(proto.encode(proto.Ready(credits=1, fingerprint=welcome.fingerprint)), RAW)
    (task,) = replies(pair, 0)
    assert isinstance(task, proto.Task) and task.acks == []

    # Its one credit free again, the worker is handed the next slot, with the ack on it.
    sent = len(pair.wire.sent)
    pair.frames(answer(pair, task, size), RAW)
    (reply,) = replies(pair, sent)
    assert isinstance(reply, proto.Task), reply
    assert reply.acks == [task.slot] and reply.slot != task.slot

    # A repeat of that result is taken (dropped, before its gradient is read: the slot is no
    # longer its sender's) and answered by no task: a plain ack.
    sent = len(pair.wire.sent)
    pair.frames(answer(pair, task, size), RAW)
    (reply2,) = replies(pair, sent)
    assert isinstance(reply2, proto.Ack) and reply2.slots == [task.slot], reply2
    assert pair.counters["results_unheld"] == 1
    pair.close()


def test_a_worker_forgets_the_results_acknowledged_on_its_tasks():
    """The other side: the real worker session, fed those tasks, keeps no result the
    coordinator acknowledged (none would be resent after a reconnect)."""
    pair = Pair(CoordinatorConfig(job="synthetic", job_args={"params": PARAMS, "batch_size": 16},
                                  partitions=2, epochs=2, eval_every=3600, heartbeat_s=0.5))
    worker = pair.worker("w", credits=1)
    pair.run(until=lambda: worker.computed >= 6, finish=False)
    results = [m.slot for m in worker.said if isinstance(m, proto.Result)]
    on_tasks = [s for r, m in pair.wire.sent if r == worker.route and isinstance(m, proto.Task)
                for s in m.acks]
    plain = [s for m in pair.wire.to(worker.route, proto.Ack) for s in m.slots]
    assert sorted(on_tasks + plain) == sorted(results), (results, on_tasks, plain)  # each once
    assert len(on_tasks) >= len(results) - 1  # on tasks, but for a last one answered by none
    assert worker.session.unacked == {}  # nothing acknowledged is kept, nor would be resent
    pair.close()
