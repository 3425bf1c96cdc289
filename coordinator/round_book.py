"""Rounds: opening them (the batch, the code, its rows as leases), answers arriving, decoding,
closing, the adaptive choice of code, and speculative copies of late slots. Pure.

A round is one batch at one model version cut into partitions and covered by the rows of a code
(DESIGN.md section 3). Each row is a lease in the lease table; a row whose copy arrived makes the
row's other copies dead (cancelled at once). Once every partition is covered and the arrived rows
decode, the round closes and `Decoded` says how to combine their gradients. With speculation, a
slot later than its holder's prediction gets a duplicate row appended to its round's code, at the
front of the queue. With verified replicas a row arrives only once two copies from two workers
agree (`VerifiedRows`, verified_rows.py; the comparison is the round core's).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..common import coding
from ..common.coding import Code, Redundancy
from . import adaptive
from .fleet import Fleet, WorkerRecord
from .leases import LeaseTable
from .local import TaskMode, inner_steps
from .locality import Locality
from .sampler import Part, Sampler
from .slots import Action, CancelSlots, CompareCopies, Decoded, Lease, LeaseState, SlotWork
from .speed import SpeedModel, WorkerSpeed
from .verified_rows import VerifiedRows

_RECHECK_FLEET = 256  # fleets up to this size look at a newcomer's slots every tick
_SPREADS_KEPT = 50  # rounds whose slot finish spread the median is taken over
PROBE_AFTER = 8  # sync rounds a worker left out waits before its first probe (slot_shares)
_UNSIZED_PARTS = 4  # parts per worker of a sync round cut before anything sizes them


@dataclass
class Round:
    id: int
    version: int
    parts: list[Part]
    code: Code
    slots: list[int]  # lease ids, in code row order
    arrived: set[int] = field(default_factory=set)  # code rows that arrived
    covered: set[int] = field(default_factory=set)  # partitions some arrived row covers
    copies: dict[tuple, list[int]] = field(default_factory=dict)  # row -> leases computing it
    verified: Optional[VerifiedRows] = None  # verify_replicas: its held copies, by row
    block: Optional[tuple[int, int]] = None  # locality: (epoch, block) its samples lie in
    finished: list[float] = field(default_factory=list)  # when each arrived row came in

    @property
    def samples(self) -> int:
        return sum(p[2] for p in self.parts)


class RoundBook:
    def __init__(self, config, sampler: Sampler, speed: SpeedModel, leases: LeaseTable,
                 fleet: Fleet, task_mode: TaskMode, locality: Optional[Locality], stats: Counter,
                 version: int = 0):
        self.config = config
        self.sampler = sampler
        self.speed = speed
        self.leases = leases
        self.fleet = fleet
        self.task_mode = task_mode
        self.locality = locality
        self.stats = stats
        self.version = version
        self.rounds: dict[int, Round] = {}
        self.accepting = True  # False: open no new rounds (shutdown)
        self.rounds_at: Counter[int] = Counter()  # open rounds per model version
        self.speculating = config.speculating
        self.last_code = "none"  # the code of the newest round
        # the batch of new rounds when it is not the job's (--batch adaptive: batch_policy.py)
        self.batch: Optional[int] = None
        self.last_costs: dict[str, float] = {}  # adaptive: the predictions behind the choice
        self._choice: tuple[Redundancy, int] = (Redundancy(), -1)  # adaptive: choice, at obs #
        self._choice_key: tuple[int, int] = (0, 0)
        self._seq = itertools.count()
        # (p90 - p10 of a round's slot finish times) / the round's time, of recent rounds: do a
        # round's slots finish together (sized parts), or does it wait for one?
        self.spreads: deque[float] = deque(maxlen=_SPREADS_KEPT)
        self._late_due: list[tuple[float, int, str]] = []  # (when a slot may be late, seq, worker)
        # the entries of `_late_due` timed by a prediction (not "at the next tick"): when the
        # driver should look next, between its ticks
        self._timed_due: list[tuple[float, int, str]] = []
        self.round_times: deque[float] = deque(maxlen=_SPREADS_KEPT)  # first hand-out to decode

    def round_of(self, lease: Lease) -> Optional[Round]:
        return self.rounds.get(lease.round)

    # opening ----------------------------------------------------------------------------------

    def open_limit(self) -> int:
        """Rounds open at once, at most: one with --sync, else --open-rounds, else what the
        fleet's credits can use: twice the rounds their credits hold (slack for stragglers),
        plus two. So a worker that asks for many credits and answers nothing cannot open rounds
        without end (the credits of one key are bounded too: budgets.py)."""
        if self.config.sync:
            return self.config.pipeline
        if self.config.open_rounds:
            return self.config.open_rounds
        return 2 * self.fleet.credits // max(1, self.config.partitions) + 2

    def can_open(self) -> bool:
        """Whether `open_round` may open one now (it can still fail on an empty plan)."""
        if not self.accepting:
            return False
        if len(self.rounds) >= self.open_limit():
            return False
        return not self.sampler.exhausted

    def open_round(self, worker: Optional[WorkerRecord] = None) -> bool:
        """Open a round at the current version (its leases wait at the back of the queue),
        from `worker`'s home block with locality. Whether one was opened."""
        if not self.accepting:
            return False
        if len(self.rounds) >= self.open_limit():
            return False
        # sync: a part for every active worker but one whose late slot is still unanswered
        # (alive, heart-beating, computing nothing: its part would hold up the round)
        takers = ([w for w in self.fleet.active() if not self.sits_out(w)]
                  if self.config.sync else [])
        k = max(1, len(takers)) if self.config.sync else self.config.partitions
        if self.config.sync and not self.stats["rounds_decoded"]:
            # The first round opens as soon as one worker announces credits: cut for it alone,
            # it would compute the whole batch while the others finish starting up. A part
            # for each of those too (equal, anyone's: nothing is measured yet), so that they
            # take theirs as they come, and whoever is free computes those that never do.
            k += sum(1 for w in self.fleet.workers.values()
                     if not (w.settled or w.capacity or w.draining))
        block = None
        if self.locality is not None and worker is not None:
            block = self.locality.block_for(worker.id, self.sampler.epoch,
                                            self.sampler.open_blocks())
        sized: list[WorkerRecord] = []
        shares = None
        batch = self.round_batch(k, worker)
        if self.config.sync and not self.sampler.replanning:
            sized, shares = self.slot_shares(takers, self.sampler.next_count(batch, block))
            if shares is not None:
                k = len(sized)
            elif not self.stats["rounds_decoded"]:
                # The first round, and the other workers may not even have said hello yet (a
                # new coordinator hears them up to a reconnect interval apart): cut for the one
                # known, it was all that worker's, and a slow one computed the whole batch at
                # its pace (one_fast: 0.55 s against 0.1 s, three runs in four)
                k = max(k, _UNSIZED_PARTS) * _UNSIZED_PARTS
            elif k >= 2:
                # Nothing to size by: more parts than workers, anyone's, so that a fast worker
                # takes several while a slow one computes one (a sync worker holds one part of
                # a round at a time), and each comes away with a first reading.
                k *= _UNSIZED_PARTS
        parts = self.sampler.next_round(batch, k, block, shares)
        if parts is None:
            return False
        if shares is None or len(parts) != len(sized):
            sized = []  # equal parts (nothing measured yet, or too few samples): anyone's
        else:
            self.stats["rounds_sized"] += 1
        code = coding.build(self.choose_code(len(parts)), len(parts))
        self.last_code = code.name
        self.stats["rounds_" + code.name.split(":")[0]] += 1
        round_id = self.leases.take_id()
        slot_ids = [0] * code.slots  # in code row order
        rows: list[list[tuple[int, float]]] = [[] for _ in range(code.slots)]
        r_idx, c_idx = np.nonzero(code.matrix)
        for r, c, v in zip(r_idx.tolist(), c_idx.tolist(), code.matrix[r_idx, c_idx].tolist()):
            rows[r].append((c, v))  # code.row(r) for every row at once
        kind, local_task = self.task_mode.kind, self.task_mode.local
        round_ = Round(round_id, self.version, list(parts), code, slot_ids,
                       verified=VerifiedRows() if self.config.verify_replicas else None,
                       block=self.sampler.block_of(parts[0]) if self.locality else None)
        for row in _queue_order(code):
            entries = rows[row]
            work = SlotWork(self.version, [list(parts[j]) for j, _ in entries],
                            [c for _, c in entries], kind)
            if local_task:  # a short slot (an epoch's end) takes fewer inner steps, never smaller
                work = SlotWork(work.version, work.parts, work.coefficients, kind,
                                inner_steps(work.samples, self.config.batch_size))
            lease = Lease(self.leases.take_id(), work, round_id, tuple(entries), index=row)
            if sized:  # code none: row i is part i, cut for the i-th worker
                lease.reserved = sized[row].id
            self.leases.add(lease)
            slot_ids[row] = lease.id
        for slot_id in slot_ids:
            round_.copies.setdefault(self.leases.leases[slot_id].row, []).append(slot_id)
        self.rounds[round_id] = round_
        self.rounds_at[self.version] += 1
        self.stats["rounds_opened"] += 1
        return True

    def slot_shares(self, workers: list[WorkerRecord],
                    samples: int) -> tuple[list[WorkerRecord], Optional[list[float]]]:
        """Slots sized to their worker (`--sync`): the workers a round of `samples` samples is
        cut for and each one's samples, so that the round's slots finish together instead of
        waiting for the slowest worker's equal part. A worker with three slots answered is
        sized by its slot times (`SlotTimes`: fixed seconds a and seconds per sample b): the
        round ends at the T where the parts (T - a) / b add up to `samples`, and a worker
        whose a alone is past T gets no part (it would end the round late whatever it
        computed), but for a one-sample probe now and then; one worker left alone computes the
        whole round. Before three, by its seconds per sample from its first result, fixed 0.
        A newcomer (no slot answered yet) beside measured workers gets a first round's part
        (samples / (4 x workers)) and the others share the rest: sized at the fleet's mean
        instead, a newcomer many times slower than the mean held its first round up by as many
        times its part (a part is a small multiple of what it costs the others to cover). Shares
        None (unsized parts, for all of `workers`) while the fleet has no reading (every worker
        a newcomer: sized by the fleet's mean, `SpeedModel.sizing`, while it has one), or for
        fewer than two workers. Only sync rounds are sized, and they are always code none: a
        row is one part, decoded with weight 1 whatever its size (the step divides the sum by
        the round's samples), and credits and buffers are shared by samples. Coded rounds
        (replicate, cyclic) keep equal parts: their rows mix parts, and one row's copies go to
        several workers."""
        if len(workers) < 2:
            return workers, None
        measured = [w for w in workers if not w.unproven]
        newcomers = [w for w in workers if w.unproven] if measured else []
        # at most a quarter of the round in all: the measured workers always share the rest
        first_part = samples / (_UNSIZED_PARTS * len(workers))
        shares = {w.id: first_part for w in newcomers}
        lines = []  # (fixed s, s per sample, worker)
        for w in measured or workers:
            fit = w.speed.slot_times.fit()
            if fit is None:
                s_per_sample = self.speed.sizing(w.speed)
                if s_per_sample is None or not s_per_sample > 0:
                    return workers, None
                fit = (0.0, s_per_sample)
            lines.append((fit[0], fit[1], w))
        lines.sort(key=lambda line: line[0])
        # water-filling, in order of fixed part: the round of those taken ends at
        # T = (samples + sum a/b) / sum 1/b, and the next is taken while its a is under that T
        num, den, taken = float(samples) - first_part * len(newcomers), 0.0, 0
        for fixed, per_sample, _ in lines:
            if taken and fixed >= num / den:
                break
            num, den, taken = num + fixed / per_sample, den + 1.0 / per_sample, taken + 1
        end = num / den
        shares.update((line[2].id, (end - line[0]) / line[1]) for line in lines[:taken])
        for _, _, w in lines[:taken]:
            w.speed.left_out = w.speed.probes = 0
        for _, _, w in lines[taken:]:
            # A fixed time measured while its owner was busy would keep it out for good (no
            # part, no new reading): a one-sample part re-reads it, after PROBE_AFTER rounds
            # left out, then twice as many each time (one truly too slow costs a round that
            # part's wait, ever more rarely)
            speed = w.speed
            speed.left_out += 1
            if speed.left_out >= PROBE_AFTER << min(speed.probes, 20):
                speed.left_out, speed.probes = 0, speed.probes + 1
                shares[w.id] = 1.0
        chosen = [w for w in workers if w.id in shares]  # in the order they were given
        return chosen, [shares[w.id] for w in chosen]

    def round_batch(self, k: int = 1, worker: Optional[WorkerRecord] = None) -> int:
        if self.task_mode.local:  # a slot as long as the worker opening the round should run
            speed = worker.speed if worker is not None else WorkerSpeed()
            return k * self.task_mode.slot_samples(speed.s_per_sample, self.config.batch_size,
                                                   speed.link_s)
        batch = self.batch or self.config.batch_size
        if self.config.max_batch:
            batch = max(1, min(batch, self.config.max_batch))
        return batch

    def choose_code(self, k: int) -> Redundancy:
        """The code policy of a new round of `k` partitions (adaptive: chosen from the fleet's
        recorded task times, again after `adaptive_every` new observations)."""
        policy = self.config.redundancy
        if self.config.sync:
            return Redundancy()
        if policy.kind != "adaptive":
            return policy
        if len(self.speed.times) < 8:
            # Nothing measured yet: assume the fleet straggles (volunteers' machines do). A
            # replicated first round or two costs little where nobody is slow, and where one is,
            # a first round without redundancy waits for it.
            if self.config.adaptive_max_level >= 2:
                return Redundancy("replicate", 2)
            return Redundancy()
        active = self.fleet.sample_active(self.config.adaptive_sample)
        choice, at = self._choice
        key = (k, len(active))
        observations = self.speed.observations
        if observations - at >= self.config.adaptive_every or self._choice_key != key:
            speculation = None
            if self.speculating:
                speculation = adaptive.Speculation(self.config.spec_sd, self.config.spec_floor_s)
            choice, self.last_costs = adaptive.choose(
                [list(w.speed.recent) for w in active] or [list(self.speed.times)], k,
                samples_per_partition=self.round_batch() / k,
                max_level=self.config.adaptive_max_level, seed=observations,
                open_rounds=self.config.open_rounds, speculation=speculation)
            self._choice = (choice, observations)
            self._choice_key = key
        return choice

    # answers ----------------------------------------------------------------------------------

    def arrive(self, lease: Lease, now: float) -> list[Action]:
        """`lease`'s result is used: its row has arrived; its copies are cancelled, and the round
        decodes (`Decoded`, the round closed) or waits for more."""
        lease.state = LeaseState.ARRIVED
        actions: list[Action] = list(self.cancel_holders(lease))
        round_ = self.rounds[lease.round]
        round_.arrived.add(lease.index)
        round_.finished.append(now)
        round_.covered.update(j for j, _ in lease.row)
        for other_id in round_.copies[lease.row]:  # replicas, speculation: not needed
            other = self.leases.leases[other_id]
            if other.needed:
                other.state = LeaseState.DEAD
                self.stats["slots_redundant"] += 1
                actions += self.cancel_holders(other, now)
        # Every partition covered is necessary for a decode: the least squares waits for it.
        if len(round_.covered) == round_.code.partitions:
            weights = coding.decode(round_.code, round_.arrived)
            if weights is not None:
                actions += self.close(round_, weights, now)
        return actions

    def hold(self, lease: Lease, worker_id: str, kin: frozenset = frozenset()) -> list[Action]:
        """A verified round's copy arrived: kept until a copy from another worker is compared
        with it. The row's other copies keep computing (they are the second opinion); only this
        lease's other holders (a deadline handed it out twice) are cancelled."""
        round_ = self.rounds[lease.round]
        assert round_.verified is not None  # only a verified round's copies are held
        round_.verified.hold(lease.row, lease.id, worker_id, kin)
        self.stats["replicas_held"] += 1
        return self.cancel_holders(lease) + self.compare_next(round_, lease.row)

    def compare_next(self, round_: Round, row: Hashable) -> list[Action]:
        """The row's next two held copies to compare, if there are two."""
        assert round_.verified is not None  # only a verified round's copies are compared
        pair = round_.verified.next_pair(row)
        if pair is None:
            return []
        first_by, second_by = (round_.verified.sender(slot) for slot in pair)
        assert first_by is not None and second_by is not None  # the pair's copies are held
        return [CompareCopies(round_.id, pair, (first_by, second_by))]

    def disputed(self, first: int, second: int) -> Optional[tuple[Round, Hashable]]:
        """The round and row of a `CompareCopies` still awaiting its verdict, else None."""
        lease = self.leases.get(first)
        round_ = self.rounds.get(lease.round) if lease is not None else None
        if round_ is None or round_.verified is None:
            return None
        row = round_.verified.row_in_dispute(first, second)
        return None if row is None else (round_, row)

    def cancel_holders(self, lease: Lease, now: Optional[float] = None) -> list[CancelSlots]:
        """Cancel `lease` on its holders; with `now`, what they computed of it so far is a
        (censored) reading of their speed."""
        def cancelled(worker: WorkerRecord, lease: Lease) -> None:
            started = lease.started.get(worker.id)
            if now is not None and lease.samples and started is not None:
                self.speed.observe((now - started) / lease.samples, worker.speed)
            self.fleet.update_hunger(worker)
            self.watch_late(worker, now if now is not None else (started or 0.0))
        return self.leases.cancel_holders(lease, self.fleet.workers, cancelled)

    def close(self, round_: Round, weights: dict[int, float],
              now: Optional[float] = None) -> list[Action]:
        actions: list[Action] = []
        if now is not None:
            self._measure_spread(round_, now)
        used = {round_.slots[row]: w for row, w in weights.items()}
        slot_samples, rows = {}, {}
        for slot_id in round_.slots:
            lease = self.leases.leases[slot_id]
            if slot_id in used:
                slot_samples[slot_id] = lease.samples
                rows[slot_id] = lease.row
            if lease.state is not LeaseState.ARRIVED:
                actions += self.cancel_holders(lease, now)
            self.leases.forget(slot_id)
        del self.rounds[round_.id]
        self.rounds_at[round_.version] -= 1
        if self.rounds_at[round_.version] <= 0:
            del self.rounds_at[round_.version]
        self.stats["rounds_decoded"] += 1
        actions.append(Decoded(
            round=round_.id, version=round_.version, parts=round_.parts, samples=round_.samples,
            weights=used, slots=list(round_.slots), slot_samples=slot_samples, rows=rows))
        return actions

    def _measure_spread(self, round_: Round, now: float) -> None:
        """How close together the round's slots finished, over its time from the first hand-out
        to its decode; rounds of one slot say nothing."""
        starts = [t for slot_id in round_.slots
                  for t in self.leases.leases[slot_id].started.values()]
        if starts and now > min(starts):
            self.round_times.append(now - min(starts))
        if len(round_.finished) < 2 or not starts or not now > min(starts):
            return
        p10, p90 = np.percentile(round_.finished, [10, 90])
        self.spreads.append(float(p90 - p10) / (now - min(starts)))

    @property
    def slot_spread(self) -> Optional[float]:
        """The median of the recent rounds' spreads (`_measure_spread`), None before any."""
        return float(np.median(self.spreads)) if self.spreads else None

    # speculation ------------------------------------------------------------------------------

    def spec_floor(self) -> float:
        """Seconds past its prediction a slot must run to be late: `spec_floor_s`, and in sync
        rounds at most the median of the recent rounds' times (once three are measured). A sync
        round waits for its last part while the workers that finished theirs sit idle: a copy
        on one of them costs nothing, and half a second of floor against rounds of tens of
        milliseconds let a dead or stopped worker's part hold the fleet for many rounds' time."""
        floor = self.config.spec_floor_s
        if self.config.sync and len(self.round_times) >= 3:
            floor = min(floor, float(np.median(self.round_times)))
        return floor

    def next_speculation_at(self) -> float:
        """When a slot may next turn late, by a prediction (math.inf: none is timed); slots
        judged "at the next tick" are not in it."""
        timed = self._timed_due
        while timed:
            _, seq, worker_id = timed[0]
            worker = self.fleet.get(worker_id)
            if worker is not None and worker.late_check == seq:
                return timed[0][0]
            heapq.heappop(timed)
        return math.inf

    def watch_late(self, worker: WorkerRecord, now: float, after: Optional[float] = None) -> None:
        """Queue the first moment a slot of `worker` may turn late (as `speculate_late` judges).

        The judgement depends on the worker's prediction and on how many slots it holds; both
        change only where this is called again, so the check comes exactly when it is due. A
        worker judged by the fleet's times (few results of its own) is looked at every tick in a
        fleet of up to `_RECHECK_FLEET` workers; in a larger one when the fleet's times of the
        moment say it is due (they drift between its own events)."""
        if not self.speculating or not worker.assigned:
            worker.late_check = None
            return
        prediction = self.speed.prediction(worker.speed)
        due = timed = math.inf
        if prediction is None or (len(self.fleet) <= _RECHECK_FLEET
                                  and self.speed.judged_by_fleet(worker.speed)):
            due = now  # the next tick
        if prediction is not None:
            queued = max(1, len(worker.assigned))
            floor = self.spec_floor()
            for lease_id in worker.assigned:
                lease = self.leases.get(lease_id)
                if (lease is None or lease.side or lease.speculated or not lease.needed
                        or worker.id not in lease.started):
                    continue
                timed = min(timed, self.speed.late_at(prediction, lease.samples, queued,
                                                      lease.started[worker.id],
                                                      _allowance(worker, lease, floor)))
        due = min(due, timed)
        if due == math.inf:
            worker.late_check = None
            return
        if after is not None:
            due = max(due, math.nextafter(after, math.inf))
            timed = max(timed, math.nextafter(after, math.inf))
        worker.late_check = next(self._seq)
        heapq.heappush(self._late_due, (due, worker.late_check, worker.id))
        if timed < math.inf:
            heapq.heappush(self._timed_due, (timed, worker.late_check, worker.id))

    def speculate_due(self, now: float) -> None:
        """Speculate on the workers whose slots may have turned late by `now`."""
        timed = self._timed_due
        while timed and timed[0][0] <= now:  # looked at now, through `_late_due`
            heapq.heappop(timed)
        due = self._late_due
        while due and due[0][0] <= now:
            _, seq, worker_id = heapq.heappop(due)
            worker = self.fleet.get(worker_id)
            if worker is None or worker.late_check != seq:
                continue
            worker.late_check = None
            self._speculate_late(worker, now)
            self.watch_late(worker, now, after=now)

    def _speculate_late(self, worker: WorkerRecord, now: float) -> None:
        """Append a duplicate row for every slot of `worker` that is late past its prediction."""
        prediction = self.speed.prediction(worker.speed)
        if prediction is None:
            return
        queued = max(1, len(worker.assigned))  # it computes its slots one after another
        floor = self.spec_floor()
        candidates = []
        for lease_id in list(worker.assigned):
            lease = self.leases.get(lease_id)
            if (lease is None or lease.side or lease.speculated or not lease.needed
                    or lease.round not in self.rounds or worker.id not in lease.started):
                continue
            elapsed = now - lease.started[worker.id]
            candidates.append((lease, elapsed, self.speed.is_late(
                prediction, lease.samples, queued, elapsed, _allowance(worker, lease, floor))))
        # A worker that has never answered computes none of its slots, as far as anyone knows,
        # once the first it was handed is late on its own (computed first, it waits for none of
        # the others): every slot it holds is late then. One that asks for many and answers
        # nothing would otherwise be judged by its whole queue's time, one slot at a time.
        every = False
        if worker.unproven and candidates:
            first, elapsed, _ = max(candidates, key=lambda c: c[1])
            every = self.speed.is_late(prediction, first.samples, 1, elapsed,
                                       _allowance(worker, first, floor))
        for lease, elapsed, late in candidates:
            if not (late or every):
                continue
            round_ = self.rounds[lease.round]
            round_.code = coding.speculate(round_.code, lease.index)
            copy = Lease(self.leases.take_id(), lease.work, round_.id, lease.row,
                         index=len(round_.slots), speculated=True)
            self.leases.add_first(copy)
            round_.slots.append(copy.id)
            round_.copies[copy.row].append(copy.id)
            lease.speculated = True
            self.stats["slots_speculated"] += 1
            if lease.samples:  # a bound: it has not answered yet
                self.speed.observe(elapsed / lease.samples, worker.speed)
            self.speed.slot_late(worker.speed)
            self._owing(worker, now)

    def sits_out(self, worker: WorkerRecord) -> bool:
        """Whether sync rounds keep `worker` out for now (`_owing`): cut no part, dealt none
        of another's."""
        speed = worker.speed
        return (self.config.sync and speed.owes
                and (self.stats["rounds_decoded"] < speed.owes_until
                     or worker.last_seen <= speed.owed_at))

    def _owing(self, worker: WorkerRecord, now: float) -> None:
        """A slot of `worker` turned late: sync rounds cut it no part for the next
        2^(late streak) - 1 rounds (4^s - 1 if it never answered anything), nor before it is
        heard from again (a heartbeat), or until it answers; then one on probation. Its late
        part is usually cancelled by the copy's answer, so an honest worker that was late once
        (its owner busy for a moment) never answers that one: without a term it would sit out
        the run. One killed or stopped sends
        no heartbeat, so it is probed only if it comes back; one that heart-beats and never
        answers, a hostile key's, costs the fleet a probe's wait in ever fewer rounds: 1 in 2,
        then 1 in 4, 1 in 8, ..."""
        worker.speed.owed_at = now
        streak = min(worker.speed.late_streak, 10)
        # one that has never answered has shown nothing but lateness: 4^s - 1 rounds out (16
        # heart-beating names that never compute, hostile.py's ready_flood, probed every 2^s
        # cost the fleet 12% of its samples per second)
        base = 4 if worker.unproven else 2
        worker.speed.owes_until = self.stats["rounds_decoded"] + base ** streak


def _allowance(worker: WorkerRecord, lease: Lease, floor: float) -> float:
    """Seconds a slot may run past its compute prediction before it is late: the floor, and
    for a slot sent with its model the worker's typical link time (the prediction is compute
    only; a model and a gradient on a slow link are not lateness)."""
    link_s = worker.speed.link_s if worker.id in lease.with_model else None
    return floor + (link_s or 0.0)


def _queue_order(code: Code) -> list[int]:
    """Rows in the order their slots are queued: first copies of every row before second copies
    (replicas, speculative duplicates), so the first workers cover the whole round."""
    seen: Counter[bytes] = Counter()
    copy = []
    for row in range(code.slots):
        key = code.matrix[row].tobytes()
        copy.append(seen[key])
        seen[key] += 1
    return sorted(range(code.slots), key=lambda r: (copy[r], r))
