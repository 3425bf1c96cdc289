"""The round core's contract, checked against both of its drivers (Flower's habit for its
strategies): the coordinator's server, in process, behind a recording transport, fed real
messages by scripted workers; and the simulator, with its fleet in virtual time.

Whatever the driver and the code, over a whole run:
- every slot is in at most one applied or replanned round, and every sample is applied at most
  once (the applied rounds' parts never overlap);
- a round applies only once results of its slots were used, and none of its slots is used after;
- a result for a slot cancelled on its worker is never used;
- the samples applied add up: the core's count, the applied rounds' samples, and (the server)
  the ledger's `applied` records;
- credit is earned only by results an applied round used, and each round's credited shares add
  up to its samples (so do the server's lasting credits, to the samples applied).

And the run core's (coordinator/run.py), evaluations on workers through the round core:
- an evaluation's answer is used at most once: the run core judges each completed evaluation
  (and each one it asked to be made here) once;
- no evaluation slot is answered after its evaluation closed: only the open evaluation takes
  sums, for its own slots;
- the run stops at most once, and only on an evaluation that met the target (or named no metric
  the target reads), of the model as it is then (a confirmation), made by the coordinator: the
  workers' sums never stop it (they may be made up); once stopped, nothing more is evaluated.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch

from idlegrad.common import protocol as proto
from idlegrad.common.job import FlatModel, coded_gradient, evaluation_sums, local_change
from idlegrad.common.tensors import from_blob, to_blob
from idlegrad.coordinator import simulator as sim
from idlegrad.coordinator.effects import Applied, Evaluated, Replanned, Used
from idlegrad.coordinator.evaluation import BAD_TARGET, TARGET
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.run import EvaluateHere, RunCore
from idlegrad.coordinator.scheduler import Assign, CancelSlots
from idlegrad.coordinator.server import Coordinator, CoordinatorConfig
from idlegrad.coordinator.target import Target

from .fakes import RecordingTransport

ENTRY_POINTS = ("join", "ready", "resend", "leave", "tick", "malformed", "result", "computed",
                "seen", "control", "stop", "evaluate", "drop_evaluation", "evaluated", "handback",
                "job_failed", "expel", "speculate")
QUERIES = ("version", "identity", "kin", "samples_per_s", "trust_summary",
           "next_speculation_at")


def test_the_contract_wraps_every_entry_point_of_the_round_core():
    """A new entry point of the core is either wrapped here or declared a query."""
    public = {name for name in dir(RoundCore) if not name.startswith("_")}
    assert public == set(ENTRY_POINTS) | set(QUERIES)


RUN_ENTRY_POINTS = ("tick", "evaluated")
RUN_QUERIES = ("target", "evaluating", "next_at", "stale")


def test_the_contract_wraps_every_entry_point_of_the_run_core():
    """A new entry point of the run core is either wrapped here or declared a query."""
    public = {name for name in dir(RunCore) if not name.startswith("_")}
    assert public == set(RUN_ENTRY_POINTS) | set(RUN_QUERIES)


def record(core) -> list:
    """Every effect the core's entry points return, in order, for the contract to read."""
    trace: list = []

    def wrap(call):
        def recorded(*args, **kwargs):
            out = call(*args, **kwargs)
            effects = out[2] if isinstance(out, tuple) else out
            trace.extend(effects)
            return out
        return recorded

    for name in ENTRY_POINTS:
        setattr(core, name, wrap(getattr(core, name)))
    return trace


def check_contract(trace: list, samples_applied: int) -> dict:
    closed: set[int] = set()  # slots of rounds applied or replanned
    used: set[int] = set()
    cancelled: set[tuple[str, int]] = set()
    assigned_to: dict[int, set[str]] = {}
    applied_samples: set[tuple[int, int]] = set()
    total = rounds = 0
    for effect in trace:
        if isinstance(effect, Assign):
            assigned_to.setdefault(effect.slot, set()).add(effect.worker)
        elif isinstance(effect, CancelSlots):
            cancelled |= {(effect.worker, s) for s in effect.slots}
        elif isinstance(effect, Used):
            assert effect.slot not in closed, f"slot {effect.slot} used after its round closed"
            used.add(effect.slot)
        elif isinstance(effect, (Applied, Replanned)):
            assert not closed & set(effect.slots), "a slot in two closed rounds"
            closed |= set(effect.slots)
            if isinstance(effect, Applied):
                assert used & set(effect.slots), f"round {effect.round} applied with no result"
                assert effect.credits and all(c.samples >= 0 for c in effect.credits)
                assert sum(c.samples for c in effect.credits) == effect.samples, effect.credits
                assert len(effect.credits) <= effect.terms
                for epoch, offset, count in effect.parts:
                    for i in range(offset, offset + count):
                        assert (epoch, i) not in applied_samples, "a sample applied twice"
                        applied_samples.add((epoch, i))
                total += effect.samples
                rounds += 1
    assert total == samples_applied == len(applied_samples)
    return {"rounds": rounds, "samples": total, "used": len(used), "cancelled": len(cancelled),
            "assigned": len(assigned_to)}


class RunCall:
    """What one call of the run core saw and returned."""

    def __init__(self, name, args, kwargs, out, before, after, version):
        self.name, self.args, self.kwargs, self.out = name, args, kwargs, out
        self.stopped_before, self.stopped_after = before, after
        self.version = version  # the model's, when it was called


class EvalAnswer:
    """A worker's answer for an evaluation slot: the evaluations whose answers it changed, and
    those closed (completed, replaced or dropped) before it came."""

    def __init__(self, slot, changed, closed):
        self.slot, self.changed, self.closed = slot, changed, closed


def record_run(run: RunCore, trace: list) -> None:
    """The run core's entry points, and the round core's evaluations (opened, answered), into
    `trace` (after `record` wrapped the round core: its effects are in `trace` already)."""
    core = run.rounds
    opened: list = []
    closed: set[int] = set()  # ids of the evaluations opened and closed since

    def wrap_run(name):
        call = getattr(run, name)

        def recorded(*args, **kwargs):
            before, version = run.stopped, core.version
            out = call(*args, **kwargs)
            trace.append(RunCall(name, args, kwargs, out, before, run.stopped, version))
            return out
        setattr(run, name, recorded)

    for name in RUN_ENTRY_POINTS:
        wrap_run(name)
    evaluate, evaluated = core.evaluate, core.evaluated

    def evaluate_recorded(*args, **kwargs):
        out = evaluate(*args, **kwargs)
        opened.append(core.evaluation)
        return out

    def evaluated_recorded(worker_id, slot, *args, **kwargs):
        closed.update(id(e) for e in opened if e is not core.evaluation)
        was = [(len(e.sums), e.compute_s) for e in opened]
        out = evaluated(worker_id, slot, *args, **kwargs)
        changed = [e for e, w in zip(opened, was) if (len(e.sums), e.compute_s) != w]
        trace.append(EvalAnswer(slot, changed, set(closed)))
        if any(isinstance(e, Evaluated) for e in out):
            closed.update(id(e) for e in changed)
        return out

    core.evaluate, core.evaluated = evaluate_recorded, evaluated_recorded


def check_run_contract(trace: list, target) -> dict:
    answers: list = []  # completed evaluations not yet judged: (version, metrics)
    here = 0  # evaluations asked to be made here, not yet judged
    stops = evaluations = 0
    for entry in trace:
        if isinstance(entry, Evaluated):
            answers.append((entry.version, entry.metrics))
        elif isinstance(entry, EvalAnswer):
            for evaluation in entry.changed:
                assert id(evaluation) not in entry.closed, \
                    f"slot {entry.slot} answered an evaluation that had closed"
                assert entry.slot in evaluation.ranges, f"slot {entry.slot} answered another's"
            assert len(entry.changed) <= 1
        elif isinstance(entry, RunCall) and entry.name == "tick":
            here += sum(isinstance(e, EvaluateHere) for e in entry.out)
            if entry.stopped_before is not None:
                assert entry.out == [], "an evaluation started after the run stopped"
        elif isinstance(entry, RunCall):  # evaluated
            version, metrics = entry.args[:2]
            outcome, start = entry.out
            here += sum(isinstance(e, EvaluateHere) for e in start)
            judged = entry.kwargs.get("judge", entry.args[4] if len(entry.args) > 4 else True)
            mine = False  # the coordinator's own evaluation
            if judged:
                evaluations += 1
                if (version, metrics) in answers:
                    answers.remove((version, metrics))
                else:
                    assert here > 0, f"an answer of version {version} used twice, or from nowhere"
                    here -= 1
                    mine = True
            if outcome in (TARGET, BAD_TARGET):  # the run stops on it
                assert mine, f"the run stopped ({outcome}) on the workers' sums"
                stops += 1
                assert entry.stopped_after == outcome
                if outcome == TARGET:
                    assert target.reached(metrics) and version == entry.version, (version,
                                                                                   entry.version)
                else:
                    assert target.metric not in metrics
            else:
                assert entry.stopped_after == entry.stopped_before, "stopped on no target"
    assert stops <= 1, f"the run stopped {stops} times"
    return {"stops": stops, "evaluations": evaluations}


# the server, in process ---------------------------------------------------------------------


class ScriptedFleet:
    """Workers speaking the real protocol to an in-process coordinator: tasks are answered in a
    random order with honest gradients (the workers' kernel, on the model each was sent), and
    one worker goes silent part-way."""

    def __init__(self, coordinator: Coordinator, workers: int, seed: int):
        self.coordinator = coordinator
        self.transport = RecordingTransport()
        coordinator.transport = self.transport
        self.routes = [f"w{i}".encode() for i in range(workers)]
        self.rng = np.random.default_rng(seed)
        self.numel = coordinator.training.model.model.numel
        self.done: dict[bytes, set[int]] = {r: set() for r in self.routes}
        self.models: dict[tuple[bytes, int], torch.Tensor] = {}  # what each was sent, by version
        training = coordinator.training
        self.job, self.train, self.seed = training.job, training.built.train, training.config.seed
        self.test = training.built.test
        self.scratch = FlatModel(self.job.build_model())

    def model(self, route: bytes, version: int) -> torch.Tensor:
        for to, sent in self.transport.sent:  # models arrive with the tasks, in order
            if (isinstance(sent, proto.Task) and sent.model is not None
                    and (to, sent.version) not in self.models):
                self.models[to, sent.version] = from_blob(sent.model).clone()
        return self.models[route, version]

    def answer(self, route: bytes, task: proto.Task) -> proto.Message:
        """A task's answer as a worker computes it: an evaluation slot's sums over its range of
        the test set (the workers' kernel), or a slot's result."""
        if task.kind != "eval":
            return proto.Result(slot=task.slot, version=task.version,
                                samples=sum(p[2] for p in task.parts), loss=1.0, compute_s=0.01,
                                gradient=self.gradient(route, task))
        self.scratch.load(self.model(route, task.version))
        ((_, offset, count),) = task.parts
        sums = evaluation_sums(self.job, self.scratch.module, self.test, offset, count)
        return proto.EvalResult(slot=task.slot, version=task.version, compute_s=0.01,
                                sums={k: [v[0], v[1]] for k, v in sums.items()})

    def gradient(self, route: bytes, task: proto.Task):
        params = self.model(route, task.version)
        if task.kind == "local":
            (part,), (coefficient,) = task.parts, task.coefficients
            return to_blob(local_change(self.job, self.scratch, params, self.train, self.seed,
                                        part, coefficient, task.steps).change)
        return to_blob(coded_gradient(self.job, self.scratch, params, self.train, self.seed,
                                      task.parts, task.coefficients))

    async def say(self, route: bytes, msg: proto.Message) -> None:
        await self.coordinator.handle([route, *proto.encode(msg)])

    async def run(self, rounds: int, silent: bytes | None = None,
                  expel: bytes | None = None) -> None:
        for route in self.routes:
            await self.say(route, proto.Hello(worker_id=route.decode(), host="h", cores=1,
                                              threads=1, device="cpu", memory_mb=1,
                                              versions={}))
            await self.say(route, proto.Ready(credits=2,
                                              fingerprint=self.coordinator.training.fingerprint))
        for step in range(rounds):
            tasks = [(r, m) for r, m in self.transport.sent
                     if isinstance(m, proto.Task) and m.slot not in self.done[r]]
            if not tasks or self.coordinator.stop_reason is not None:
                break
            route, task = tasks[int(self.rng.integers(len(tasks)))]
            self.done[route].add(task.slot)
            if route == silent and step > rounds // 3:
                continue  # it computes nothing more, until it is evicted
            await self.say(route, self.answer(route, task))
            now = time.monotonic()
            if step == rounds // 2 and silent is not None:  # evicted: its slots go to others
                await self.coordinator.perform(self.coordinator.core.leave(
                    silent.decode(), "silent", now))
            if step % 7 == 0:
                await self.coordinator.perform(self.coordinator.core.tick(now))
                await self.coordinator.perform(self.coordinator.training.run.tick(now))
            held = self.coordinator.core.scheduler.workers.get(route.decode())
            if step % 11 == 5 and held is not None and held.assigned:  # its cap is spent
                await self.coordinator.perform(self.coordinator.core.handback(
                    route.decode(), sorted(held.assigned)[:1], now))
            if step == 2 * rounds // 3 and expel is not None:  # the operator bans a key
                await self.coordinator.perform(self.coordinator.core.expel(
                    expel.decode(), "banned by the operator", now))


@pytest.mark.parametrize("redundancy,verify,task", [
    ("none", False, "gradient"), ("replicate:2", False, "gradient"),
    ("cyclic:1", False, "gradient"), ("replicate:2", True, "gradient"),
    ("replicate:2", False, "local:3")])
def test_the_server_keeps_the_round_contract(tmp_path, redundancy, verify, task):
    ledger = tmp_path / "ledger.jsonl"
    coordinator = Coordinator(CoordinatorConfig(
        job="synthetic", job_args={"params": 400, "samples": 2048}, redundancy=redundancy,
        verify_replicas=verify, task=task, partitions=4, open_rounds=3, heartbeat_s=1000,
        speculate=False, ledger_path=str(ledger), min_deadline_s=1e6, eval_on="workers",
        settle_on="coordinator", eval_every=1e-3, target=Target.parse("accuracy>=1.01")))
    trace = record(coordinator.core)
    record_run(coordinator.training.run, trace)
    coordinator.open_logs()
    fleet = ScriptedFleet(coordinator, workers=5, seed=len(redundancy))
    try:
        asyncio.run(fleet.run(rounds=300, silent=fleet.routes[-1], expel=fleet.routes[-2]))
    finally:
        coordinator.records.close()
    figures = check_contract(trace, coordinator.samples_applied)
    assert figures["rounds"] >= 5, figures
    evaluations = check_run_contract(trace, coordinator.training.run.target)
    assert evaluations["evaluations"] >= 2 and evaluations["stops"] == 0, evaluations
    # the script handed slots back and had the operator ban a key, through the core
    assert coordinator.core.scheduler.stats["slots_handed_back"] > 0
    assert coordinator.core.counters["workers_banned"] == 1
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    ledger_samples = sum(p[2] for r in records if r["event"] == "applied" for p in r["parts"])
    assert ledger_samples == coordinator.samples_applied
    credits = coordinator.training.credits
    assert credits.samples == coordinator.samples_applied
    assert set(credits.accounts) == {route.decode() for route in fleet.routes}
    verified = sum(a.verified for a in credits.accounts.values())
    assert (verified > 0) == verify, verified
    shown = coordinator.snapshot()["credits"]["workers"]  # what monitors read, by name
    assert set(shown) == set(credits.accounts)
    assert sum(row["samples"] for row in shown.values()) == coordinator.samples_applied


def test_the_server_stops_once_on_the_target_its_evaluation_slots_met():
    """Evaluations on workers, through the server: the first met the target (confirmed on the
    model as it is then, here) and the run stopped, once."""
    coordinator = Coordinator(CoordinatorConfig(
        job="synthetic", job_args={"params": 400, "samples": 2048}, partitions=4, open_rounds=3,
        heartbeat_s=1000, speculate=False, min_deadline_s=1e6, eval_on="workers",
        eval_every=1e-3, target=Target.parse("loss<=1e9")))
    trace = record(coordinator.core)
    record_run(coordinator.training.run, trace)
    fleet = ScriptedFleet(coordinator, workers=3, seed=0)
    asyncio.run(fleet.run(rounds=300))
    check_contract(trace, coordinator.samples_applied)
    assert check_run_contract(trace, coordinator.training.run.target)["stops"] == 1
    assert coordinator.stop_reason == "target"
    assert coordinator.counters["evaluations_workers"] >= 1


def test_a_cancelled_slots_late_result_is_not_used():
    """Through the server: a slot answered by one holder is cancelled on the other, whose late
    answer is then refused (not used, not counted)."""
    coordinator = Coordinator(CoordinatorConfig(
        job="synthetic", job_args={"params": 400, "samples": 512}, redundancy="replicate:2",
        partitions=1, open_rounds=1, heartbeat_s=1000, speculate=False))
    trace = record(coordinator.core)
    fleet = ScriptedFleet(coordinator, workers=2, seed=0)

    async def go():
        for route in fleet.routes:
            await fleet.say(route, proto.Hello(worker_id=route.decode(), host="h", cores=1,
                                               threads=1, device="cpu", memory_mb=1, versions={}))
            await fleet.say(route, proto.Ready(credits=1,
                                               fingerprint=coordinator.training.fingerprint))
        (a, first), (b, second) = [(r, m) for r, m in fleet.transport.sent
                                   if isinstance(m, proto.Task)][:2]
        assert first.slot != second.slot and a != b
        for route, task in ((a, first), (b, second)):
            await fleet.say(route, proto.Result(slot=task.slot, version=0, samples=1, loss=1.0,
                                                compute_s=0.01, gradient=fleet.gradient(route, task)))

    asyncio.run(go())
    cancels = [e for e in trace if isinstance(e, CancelSlots)]
    used = [e.slot for e in trace if isinstance(e, Used)]
    # (dropped before its gradient is read: the cancelled slot is no longer its sender's)
    assert len(used) == 1 and coordinator.counters["results_unheld"] == 1, trace
    assert cancels and all(used[0] not in c.slots for c in cancels)
    check_contract(trace, coordinator.samples_applied)


# the simulator ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,verify,task,shards", [
    ("none", False, "gradient", 0), ("replicate:2", False, "gradient", 0),
    ("cyclic:1", False, "gradient", 0), ("adaptive", False, "gradient", 0),
    ("replicate:2", True, "gradient", 0), ("sync", False, "gradient", 0),
    ("replicate:2", False, "local:4", 0), ("none", False, "local:auto", 0),
    # sharded data with locality: the scheduler prefers each worker's shards
    ("none", False, "gradient", 32), ("replicate:2", True, "gradient", 32),
    ("cyclic:1", False, "gradient", 32), ("replicate:2", False, "local:4", 32)])
def test_the_simulator_keeps_the_round_contract(mode, verify, task, shards):
    rng = np.random.default_rng(3)
    fleet = sim.lognormal_fleet(12, 0.002, 0.6, rng, jitter=0.2, stall_p=0.05, stall_s=2.0)
    for w in fleet[:3]:  # churn: three workers leave for good
        w.sessions = [(0.0, 5.0)]
    simulation = sim.Simulation(fleet, sim.SimConfig(
        duration_s=30.0, batch_size=128, partitions=4, train_samples=4096, task_timeout_s=1.0,
        verify_replicas=verify, task=task, seed=1, shards=shards, shard_bytes=2**16,
        shuffle_window=2, eval_every_s=0.5, test_samples=700), mode)
    assert (simulation.scheduler.locality is not None) == (shards > 0 and mode != "sync")
    trace = record(simulation.core)
    record_run(simulation.run_core, trace)
    result = simulation.run()
    figures = check_contract(trace, result.samples_applied)
    assert figures["rounds"] >= 20, figures
    evaluations = check_run_contract(trace, None)
    assert evaluations["evaluations"] >= 3 and result.eval_slots >= 9, evaluations


@pytest.mark.parametrize("mode", ["none", "replicate:2", "sync"])
def test_the_simulator_stops_once_on_the_target_its_evaluation_slots_met(mode):
    fleet = sim.lognormal_fleet(8, 0.002, 0.6, np.random.default_rng(3), jitter=0.2,
                                stall_p=0.05, stall_s=2.0)
    target = Target.parse("version>=40")  # costless gradients: the metric is the version
    simulation = sim.Simulation(fleet, sim.SimConfig(
        duration_s=300.0, batch_size=128, partitions=4, train_samples=4096, task_timeout_s=1.0,
        seed=1, eval_every_s=0.5, test_samples=700), mode, target=target)
    trace = record(simulation.core)
    record_run(simulation.run_core, trace)
    result = simulation.run()
    check_contract(trace, result.samples_applied)
    assert check_run_contract(trace, target)["stops"] == 1
    assert result.stopped == "target" and result.duration_s < 300.0
