"""Lasting credit (coordinator/credits.py), purely: fed by the round core's effects, earned only
by applied rounds, saved and loaded as a checkpoint holds it, shown by name."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idlegrad.common.coding import parse_redundancy
from idlegrad.common.errors import CheckpointError
from idlegrad.coordinator import checkpoint
from idlegrad.coordinator.credits import Credits, shares
from idlegrad.coordinator.effects import (
    Applied, Compute, Contribution, Joined, Refused, Replanned, Used)
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import Assign, Scheduler, SchedulerConfig
from idlegrad.coordinator.trust import TrustConfig, TrustPolicy

QUIET = dict(min_deadline_s=1000.0, heartbeat_s=1000.0, speculate=False)


# shares -----------------------------------------------------------------------------------------


@given(st.integers(0, 10_000), st.lists(st.integers(0, 5_000), min_size=1, max_size=12))
def test_shares_are_whole_add_up_and_follow_the_sizes(total, sizes):
    out = shares(total, sizes)
    assert sum(out) == total and all(n >= 0 for n in out)
    weight = sum(sizes)
    for n, size in zip(out, sizes):
        exact = total * size / weight if weight else total / len(sizes)
        assert abs(n - exact) < 1  # never more than a sample from its exact share


def test_shares_of_slots_that_cover_the_round_are_their_own_samples():
    assert shares(64, [16, 16, 32]) == [16, 16, 32]
    assert shares(10, [1, 1, 1]) == [4, 3, 3]  # the leftover to the earliest of equals
    assert shares(5, []) == []


# Credits on its own ---------------------------------------------------------------------------


def applied(samples: int, *credits: Contribution) -> Applied:
    return Applied(round=1, version=1, parts=[(0, 0, samples)], samples=samples, staleness=0,
                   weight=1.0, terms=len(credits), slots=[1, 2], credits=credits)


def test_applied_rounds_earn_and_nothing_else_does():
    credits = Credits()
    credits.take([Joined("w1", "key:A"), Joined("w2", "w2")], now=100.0)
    credits.take([Used(1), Replanned(round=1, staleness=40, terms=2, slots=[1, 2])], now=101.0)
    assert credits.samples == 0
    credits.take([applied(48, Contribution("key:A", 32, 1.5, ("key:A", "w2")),
                          Contribution("w2", 16, 0.25))], now=102.0)
    credits.take([Refused("w2", "w2", 7, "non-finite")], now=103.0)
    table = credits.table()
    assert table == {"identities": 2, "workers": {
        "w1": {"samples": 32, "compute_s": 1.5, "verified": 1, "refused": 0,
               "first_seen": 100.0, "last_seen": 102.0},
        "w2": {"samples": 16, "compute_s": 0.25, "verified": 1, "refused": 1,
               "first_seen": 100.0, "last_seen": 103.0}}}
    assert list(table["workers"]) == ["w1", "w2"]  # the most samples first
    assert credits.samples == 48


def test_a_key_is_shown_by_the_name_it_last_used_and_names_never_collide():
    credits = Credits()
    credits.take([Joined("alice", "key:AAAAAAAAAAAAAAAA"),
                  Joined("bob", "key:BBBBBBBBBBBBBB")], 1.0)
    credits.take([Joined("laptop", "key:AAAAAAAAAAAAAAAA"),
                  Joined("laptop", "key:BBBBBBBBBBBBBB"),  # the name moved to another key
                  Joined("laptop", "laptop")], 2.0)  # and a worker without keys (another run)
    credits.take([applied(10, Contribution("key:AAAAAAAAAAAAAAAA", 6, 0.0),
                          Contribution("key:BBBBBBBBBBBBBB", 4, 0.0))], 3.0)
    workers = credits.table()["workers"]
    assert len(workers) == 3
    assert workers["laptop (key:AAAAAAAA...)"]["samples"] == 6
    assert workers["laptop (key:BBBBBBBB...)"]["samples"] == 4
    assert workers["laptop"]["samples"] == 0


def test_the_table_is_bounded_and_the_accounts_too():
    credits = Credits(max_accounts=50)
    for i in range(40):
        credits.take([Joined(f"w{i}", f"w{i}"),
                      applied(1 + i, Contribution(f"w{i}", 1 + i, 0.0))], float(i))
    for i in range(200):  # a churn of worker ids that never earn anything
        credits.take([Joined(f"idle{i}", f"idle{i}")], 100.0 + i)
    assert len(credits.accounts) <= 50
    assert all(f"w{i}" in credits.accounts for i in range(40))  # earners are never forgotten
    assert "idle199" in credits.accounts  # the newest stay
    top = credits.table(limit=3)
    assert list(top["workers"]) == ["w39", "w38", "w37"]
    assert top["identities"] == len(credits.accounts)


def test_saved_in_a_checkpoint_and_loaded_as_they_were(tmp_path):
    credits = Credits()
    credits.take([Joined("w1", "key:A"), Joined("w\u202e2", "w\u202e2"),
                  applied(48, Contribution("key:A", 40, 2.5, ("key:A",)),
                          Contribution("w\u202e2", 8, 0.5)),
                  Refused("w\u202e2", "w\u202e2", 3, "replica")], now=1700000000.25)
    checkpoint.save(str(tmp_path), {"credits": credits.state_dict()})
    state = checkpoint.load(str(tmp_path))  # weights_only: plain containers only
    again = Credits.from_state(state["credits"])
    assert again.table() == credits.table()
    assert Credits.from_state(None).table() == {"workers": {}, "identities": 0}
    for bad in ({"format": 2, "accounts": {}}, {"format": 1, "accounts": {"x": {"name": "x"}}},
                {"format": 1, "accounts": []}, {}):
        with pytest.raises(CheckpointError, match="credits"):
            Credits.from_state(bad)


# fed by the round core ------------------------------------------------------------------------


class Floats:
    """A model backend whose results are plain numbers: two agree when within 1e-3."""

    def __init__(self, stale: bool = False):
        self.version = 0
        self.stale = stale

    def apply(self, terms, norms, samples, round_version, in_use):
        if self.stale:
            return None
        self.version += 1
        return 1.0

    def distance(self, a, b):
        return abs(a - b)

    def size(self, a):
        return abs(a)


def core_of(redundancy="none", partitions=2, verify=False, stale=False) -> RoundCore:
    scheduler = Scheduler(SchedulerConfig(
        batch_size=8, partitions=partitions, redundancy=parse_redundancy(redundancy),
        verify_replicas=verify, open_rounds=1, **QUIET), Sampler(64, None))
    return RoundCore(scheduler, Floats(stale), TrustPolicy(TrustConfig(norm_factor=0)))


def join(core, credits, workers, now=0.0) -> list[Assign]:
    tasks = []
    for worker in workers:
        effects = core.join(worker, {"host": worker}, f"key:{worker.upper()}", now)
        effects += core.ready(worker, 1, now)
        credits.take(effects, 1000.0 + now)
        tasks += [e for e in effects if isinstance(e, Assign)]
    return tasks


def answer(core, credits, task: Assign, value: float = 1.0, now: float = 1.0) -> list:
    effects = core.result(task.worker, task.slot, value, abs(value) if math.isfinite(value)
                          else math.nan, 0.5, now)
    credits.take(effects, 1000.0 + now)
    return effects


def test_the_core_credits_each_used_result_of_an_applied_round():
    core, credits = core_of(), Credits()
    a, b = join(core, credits, ["a", "b"])
    answer(core, credits, a)
    effects = answer(core, credits, b)
    (step,) = [e for e in effects if isinstance(e, Applied)]
    assert sorted(c.identity for c in step.credits) == ["key:A", "key:B"]
    workers = credits.table()["workers"]
    assert workers["a"]["samples"] == workers["b"]["samples"] == 4
    assert workers["a"]["compute_s"] == 0.5 and workers["a"]["first_seen"] == 1000.0
    assert credits.samples == core.samples_applied == 8


def test_a_replanned_round_earns_nothing_and_a_refused_result_counts_against():
    core, credits = core_of(stale=True), Credits()
    a, b = join(core, credits, ["a", "b"])
    answer(core, credits, a)
    effects = answer(core, credits, b)
    assert any(isinstance(e, Replanned) for e in effects)
    assert credits.samples == 0 == core.samples_applied
    core, credits = core_of(), Credits()
    a, b = join(core, credits, ["a", "b"])
    effects = answer(core, credits, a, value=math.nan)
    assert any(isinstance(e, Refused) for e in effects)
    assert credits.table()["workers"]["a"]["refused"] == 1
    assert credits.samples == 0


def test_verified_copies_earn_both_senders_a_verified_slot_and_the_used_one_the_samples():
    core, credits = core_of("replicate:2", partitions=1, verify=True), Credits()
    a, b = join(core, credits, ["a", "b"])
    assert a.parts == b.parts
    answer(core, credits, a, 1.0)
    answer(core, credits, b, 1.0)
    workers = credits.table()["workers"]
    assert (workers["a"]["verified"], workers["b"]["verified"]) == (1, 1)
    assert workers["a"]["samples"] + workers["b"]["samples"] == 8 == core.samples_applied
    assert workers["a"]["samples"] == 8  # the first copy is the one used


def test_a_disagreement_settled_verifies_the_right_copy_and_refuses_the_wrong_one():
    core, credits = core_of("replicate:2", partitions=1, verify=True), Credits()
    a, b = join(core, credits, ["a", "b"])
    answer(core, credits, a, 1.0)
    effects = answer(core, credits, b, -1.0)  # a flipped sign: the coordinator computes it
    (request,) = [e for e in effects if isinstance(e, Compute)]
    credits.take(core.computed(-1.0, None, 2.0), 1002.0)  # b was right
    workers = credits.table()["workers"]
    assert (workers["b"]["verified"], workers["b"]["samples"]) == (1, 8)
    assert (workers["a"]["verified"], workers["a"]["samples"], workers["a"]["refused"]) == (0, 0, 1)


def test_results_used_in_a_round_thrown_away_as_too_stale_earn_nothing():
    """Credit is for applied work: a verified row whose copies agreed, and were used in their
    round, earns neither copy anything (samples, compute, verified slot) when the round is then
    too stale to apply; the next round that is applied earns as usual."""
    core, credits = core_of("replicate:2", partitions=1, verify=True, stale=True), Credits()
    a, b = join(core, credits, ["a", "b"])
    answer(core, credits, a, 1.0)
    effects = answer(core, credits, b, 1.0)
    assert any(isinstance(e, Used) for e in effects)  # the row was used in its round ...
    assert any(isinstance(e, Replanned) for e in effects)  # ... which was thrown away
    workers = credits.table()["workers"]
    for worker in ("a", "b"):
        assert (workers[worker]["samples"], workers[worker]["compute_s"],
                workers[worker]["verified"]) == (0, 0.0, 0)
    assert credits.samples == 0 == core.samples_applied
    core.backend.stale = False  # the replanned samples, computed again, are applied
    tasks = [e for e in effects if isinstance(e, Assign)]
    for task in tasks:
        answer(core, credits, task, 1.0, now=2.0)
    assert credits.samples == core.samples_applied == 8
    workers = credits.table()["workers"]
    assert sum(workers[w]["verified"] for w in ("a", "b")) == 2
