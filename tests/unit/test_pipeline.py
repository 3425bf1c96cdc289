"""Pipelined synchronous rounds (`--sync --pipeline N`): N sized rounds open at once, so that a
worker computes its part of the next round while the last one travels back, is summed and
stepped, and the next model travels out. A fake clock: a task reaches its worker `LATENCY`
seconds after it is handed out (the model's way out), and a worker computes the parts it holds
one after another, each in (its seconds per sample) x (samples)."""

from __future__ import annotations

import pytest

from idlegrad.common.errors import ConfigError
from idlegrad.coordinator.scheduler import Assign, Decoded, SchedulerConfig
from .scheduling import make

SPEED = {"a": 0.001, "b": 0.002, "c": 0.003}  # seconds per sample
LATENCY = 0.03


class Fleet:
    def __init__(self, pipeline: int, credits: int = 2, batch: int = 120):
        self.s = make(n=1_000_000, batch=batch, sync=True, pipeline=pipeline)
        self.now = 0.0
        self.queues: dict[str, list[tuple[float, Assign]]] = {w: [] for w in SPEED}
        self.free_at = dict.fromkeys(SPEED, 0.0)
        self.decoded: list[tuple[int, int]] = []  # (the round's version, the version it met)
        self.most_held = 0
        for w in SPEED:
            self.s.join(w, {}, self.now)
        for w in SPEED:
            self._take(self.s.ready(w, credits, self.now))

    def _take(self, actions) -> None:
        for task in (a for a in actions if isinstance(a, Assign)):
            queue = self.queues[task.worker]
            assert all(held.round != task.round for _, held in queue)  # one part a round
            queue.append((self.now + LATENCY, task))
            self.most_held = max(self.most_held, len(queue))
        for decoded in (a for a in actions if isinstance(a, Decoded)):
            self.decoded.append((decoded.version, self.s.version))
            self._take(self.s.applied(self.s.version + 1, self.now))

    def run(self, rounds: int) -> float:
        while len(self.decoded) < rounds:
            finish = {}
            for w, queue in self.queues.items():
                if queue:
                    arrives, task = queue[0]
                    finish[w] = max(self.free_at[w], arrives) + SPEED[w] * task.work.samples
            w = min(finish, key=finish.get)
            self.now = self.free_at[w] = finish[w]
            _, task = self.queues[w].pop(0)
            for other in SPEED:
                self.s.seen(other, self.now)
            _, actions = self.s.result(w, task.slot, SPEED[w] * task.work.samples, self.now)
            self._take(actions)
        return self.now


def test_a_pipelined_fleet_computes_the_next_round_while_the_last_one_travels():
    plain, piped = Fleet(pipeline=1), Fleet(pipeline=2)
    t_plain, t_piped = plain.run(40), piped.run(40)
    # one round at a time: each waits for its model to arrive (LATENCY) before computing
    assert plain.most_held == 1
    assert all(version == met for version, met in plain.decoded)
    # two: each worker holds a part of each open round, and is never idle for the model
    assert piped.most_held == 2
    assert t_piped < 0.8 * t_plain
    # a pipelined round's gradient is applied one step after its model, never more
    stale = [met - version for version, met in piped.decoded]
    assert max(stale) == 1 and stale[5:].count(1) == len(stale) - 5
    # still sized to each worker: a round's parts follow the speeds
    assert piped.s.stats["rounds_sized"] >= 30


def test_a_worker_with_one_credit_is_not_pipelined():
    fleet = Fleet(pipeline=2, credits=1)
    fleet.run(10)
    assert fleet.most_held == 1


def test_pipeline_needs_synchronous_rounds_and_a_positive_depth():
    with pytest.raises(ConfigError, match="--pipeline"):
        SchedulerConfig(batch_size=8, pipeline=2)
    with pytest.raises(ConfigError, match="at least 1"):
        SchedulerConfig(batch_size=8, sync=True, pipeline=0)
    assert SchedulerConfig(batch_size=8, sync=True, pipeline=3).pipeline == 3
