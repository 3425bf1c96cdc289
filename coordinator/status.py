"""The status snapshot a monitor gets: a pure function of the scheduler and the coordinator's state.

No sockets, no clock: `now` (scheduler time, monotonic seconds) is an argument, so the cost and
the content are unit-tested with a scheduler of any size. Bounded whatever the run's length and
the fleet's size: the curve and the events are ring buffers, at most `events_limit` events and
`WORKERS_PER_STATUS` worker rows go out per snapshot.
"""

from __future__ import annotations

import itertools
import socket
from collections import deque
from typing import Any, Iterable, Optional, Sequence

from .credits import SHOWN_PER_STATUS
from .scheduler import Scheduler, WorkerRecord

CURVE_POINTS = 300  # evaluations kept for the monitor's chart
EVENTS_PER_STATUS = 200
# Worker rows per snapshot, in the order they joined (`workers_total` counts them all): a
# monitor shows a screenful, and a snapshot must decode within the protocol's 1 MiB header
# limit however large the fleet and however long what its workers call themselves.
WORKERS_PER_STATUS = 1000
NAME_CHARS = 64  # of a row's host and device


def worker_state(w: WorkerRecord) -> str:
    """What the worker does: its own word, except that one holding slots is working (its
    heartbeat may fall between two short slots) and one being drained is draining."""
    if w.draining:
        return "draining"
    if w.state == "idle" and w.assigned:
        return "working"
    return w.state


def worker_row(w: WorkerRecord, now: float, samples_per_s: Optional[float] = None) -> dict:
    """`samples_per_s`: of its results used in applied rounds (rates.py); None: its compute
    speed, where no record of applied rounds is kept (the simulator)."""
    info = w.info
    speed = round(1.0 / w.s_per_sample, 2) if w.s_per_sample else 0.0
    return {
        "id": w.id, "host": str(info.get("host", ""))[:NAME_CHARS],
        "device": str(info.get("device", ""))[:NAME_CHARS],
        "cores": info.get("cores", 0), "threads": info.get("threads", 0), "state": worker_state(w),
        "credits": w.capacity, "assigned": len(w.assigned), "done": w.done, "samples": w.samples,
        "cancelled": w.cancelled, "missed": w.missed, "failed": w.failed,
        "samples_per_s": round(samples_per_s, 2) if samples_per_s is not None else speed,
        # what it computes per second while it computes (its speed), not what it contributes
        "compute_samples_per_s": speed,
        "staleness": round(w.staleness / w.done, 3) if w.done else 0.0,
        "compute_s": round(w.compute_s, 3),
        # link seconds per slot sent with a model (down and up); local:auto sizes H from it
        "link_s": round(w.link_s, 3) if w.link_s is not None else None,
        # share of its time in this session spent computing slots (what prefetch keeps high)
        "busy": round(min(1.0, w.compute_s / (now - w.joined)), 3) if now > w.joined else 0.0,
        "last_seen_s": round(now - w.last_seen, 3), "joined_s": round(now - w.joined, 3),
        "evaluated": w.side_samples,  # test samples evaluated (not training: no credit)
    }


def events_after(events: Sequence[dict], cursor: int, limit: int = EVENTS_PER_STATUS) -> list[dict]:
    """The newest `limit` events with an id above `cursor`. Ids are consecutive in the ring, so
    this slices instead of scanning."""
    if not events or limit <= 0:
        return []
    first = events[0]["id"]
    start = max(0, cursor + 1 - first, len(events) - limit)
    if isinstance(events, deque):
        return [events[i] for i in range(start, len(events))]
    return list(events[start:])


def rounds_summary(scheduler: Scheduler) -> dict:
    stats = scheduler.stats
    return {
        "open": len(scheduler.rounds),
        "pending_slots": scheduler.pending(),
        "opened": stats["rounds_opened"],
        "decoded": stats["rounds_decoded"],
        "replanned": stats["rounds_replanned"],
        "slots_requeued": stats["slots_requeued"],
        "deadline_requeues": stats["deadline_requeues"],
        "results_used": stats["results_used"],
        "results_duplicate": stats["results_duplicate"],
        "results_unexpected": stats["results_unexpected"],
        "workers_removed": stats["workers_removed"],
        "side_slots": stats["side_slots"],
        "side_answered": stats["side_answered"],
        "side_requeued": stats["side_requeued"],
    }


def build_snapshot(scheduler: Scheduler, now: float, base: dict[str, Any],
                   curve: Iterable[dict] = (), events: Sequence[dict] = (), cursor: int = 0,
                   last_event: int = 0, redundancy: Optional[dict] = None,
                   events_limit: int = EVENTS_PER_STATUS,
                   worker_rates: Optional[dict[str, float]] = None) -> dict:
    """The snapshot: `base` (job, version, samples, metrics... from the coordinator) plus the
    workers, rounds, redundancy, curve and the events after `cursor`."""
    snap = dict(base)
    if scheduler.paused and snap.get("state") == "training":
        snap["state"] = "paused"
    snap["paused"] = scheduler.paused
    if not scheduler.quorum and snap.get("state") == "training":
        snap["state"] = (f"waiting for workers ({len(scheduler.workers)} of "
                         f"{scheduler.config.min_workers})")
    snap["workers"] = [worker_row(w, now, None if worker_rates is None
                                  else worker_rates.get(w.id, 0.0)) for w in
                       itertools.islice(scheduler.workers.values(), WORKERS_PER_STATUS)]
    snap["workers_total"] = len(scheduler.workers)
    snap["rounds"] = rounds_summary(scheduler)
    snap["redundancy"] = dict(redundancy or {})
    snap["curve"] = list(curve)
    snap["events"] = events_after(events, cursor, events_limit)
    snap["cursor"] = last_event
    return snap


def evaluation_summary(evaluation, scheduler: Scheduler) -> Optional[dict]:
    """The evaluation in flight on workers, if any: its version, slots, answers, and who holds
    its unanswered slots (a bounded list)."""
    if evaluation is None:
        return None
    holders = sorted({w for slot in scheduler.side.values() for w in slot.holders})
    return {"version": evaluation.version, "slots": len(evaluation.ranges),
            "answered": len(evaluation.sums), "holders": holders[:64]}


def coordinator_snapshot(training, now: float, cursor: int = 0, stopping: bool = False,
                         events_limit: int = EVENTS_PER_STATUS) -> dict:
    """The status endpoint's answer for a coordinator's `Training` (training.py) at `now`."""
    config, core, scheduler = training.config, training.core, training.scheduler
    target = training.run.target
    counters = core.counters
    total_rate, worker_rates = training.rates.rates(now, training.started)
    base = {
        "job": training.job.name, "fingerprint": training.fingerprint,
        "instance": training.instance,
        "state": "stopping" if stopping else "training",
        "version": training.version, "samples": core.samples_applied,
        # epochs of samples applied, as `samples` counts them (the sampler's progress counts
        # samples planned: it runs ahead by the rounds open)
        "epoch": round(core.samples_applied / max(1, len(training.built.train)), 4),
        "epochs": config.epochs,
        "train_samples": len(training.built.train), "elapsed_s": round(training.elapsed(now), 3),
        "samples_per_s": round(total_rate, 2), "loss": core.train_loss,
        "metrics": training.metrics, "target": str(target) if target else None,
        "target_metric": target.metric if target else None,
        "target_value": target.value if target else None,
        "target_higher": target.higher_is_better if target else None,
        "counters": dict(counters), "bad_messages": dict(training.bad_messages),
        "trust": core.trust_summary(),
        "host": _HOST,
        "task": str(training.task_mode),
        "bytes_per_sample": training.bytes_per_sample(),
        "credits": training.credits.table(SHOWN_PER_STATUS),
        # the data plane: what this coordinator served, what workers say of their caches
        "data": training.data.summary(),
        "eval_on": training.eval_on,
        "evaluation": evaluation_summary(core.evaluation, scheduler),
        # the gradient noise scale, measured from the applied rounds (noise.py)
        "noise": core.noise.summary(),
        # the round batch: now, the job's, and the learning-rate rule (batch_policy.py)
        "batch": core.batching.summary(),
    }
    staleness = config.staleness
    compensator = training.model.aggregator.compensator
    stats = scheduler.stats
    redundancy = {
        "code": scheduler.last_code,
        "predicted_s_per_sample": {k: round(v, 9) for k, v in scheduler.last_costs.items()},
        "policy": "sync" if training.mode.sync else str(scheduler.config.redundancy),
        "mode": training.mode.name, "mode_reason": training.mode.reason,
        "partitions": config.partitions, "max_batch": config.max_batch,
        "speculate": scheduler.config.speculating,
        "slots_speculated": stats["slots_speculated"],
        "slots_redundant": stats["slots_redundant"],
        # --sync rounds cut to their workers' speeds (round_book.py `slot_shares`)
        "rounds_sized": stats["rounds_sized"],
        "slot_spread": _rounded(scheduler.slot_spread),
        "rounds_by_code": {k: stats["rounds_" + k] for k in ("none", "replicate", "cyclic")
                           if stats["rounds_" + k]},
        "open_rounds_limit": config.open_rounds,
        "staleness_rule": staleness.kind, "max_staleness": staleness.max_staleness,
        "rounds_too_stale": counters["rounds_too_stale"],
        # --delay-compensation: stale rounds corrected, and those whose model was not kept
        "delay_compensation": str(compensator.setting),
        "rounds_compensated": compensator.compensated,
        "rounds_uncompensated": compensator.without_snapshot,
        "rounds_rejected": counters["rounds_rejected"],
        "verify_replicas": scheduler.config.verify_replicas,
        "replicas_agreed": stats["replicas_agreed"],
        "replicas_disagreed": stats["replicas_disagreed"],
    }
    return build_snapshot(scheduler, now, base, curve=training.curve, events=training.events,
                          cursor=cursor, last_event=training.event_id, redundancy=redundancy,
                          events_limit=events_limit, worker_rates=worker_rates)


_HOST = socket.gethostname()


def _rounded(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None else round(value, digits)
