"""Local-SGD tasks (issue 9): `--task` parsing, H sizing, the refused combinations, the outer step
against a plain reference, the worker's inner steps against a plain reference, and rounds sized
for the worker that opens them."""

from __future__ import annotations

import threading

import pytest
import torch

from idlegrad.common import protocol as proto
from idlegrad.common.coding import Redundancy, parse_redundancy
from idlegrad.common.errors import ConfigError, ProtocolError
from idlegrad.common.job import FlatModel, build, gather, load_job, local_change
from idlegrad.common.tensors import distance, finite_norm
from idlegrad.common.permutation import part_indices
from idlegrad.coordinator import outer
from idlegrad.coordinator.aggregator import Aggregator, StalenessRule
from idlegrad.coordinator.local import (
    TaskMode, check_redundancy, inner_steps, parse_task)
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import Assign, Scheduler, SchedulerConfig
from .scheduling import Dealing
from idlegrad.coordinator.slots import SlotWork
from idlegrad.coordinator.trust import matches
from idlegrad.worker.engine import Cancelled, Engine, Work


def one_line(exc) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


# --task ------------------------------------------------------------------------------------------


def test_parse_task_kinds():
    assert parse_task("gradient") == TaskMode() and not parse_task("gradient").local
    fixed = parse_task("local:10")
    assert fixed.local and not fixed.auto and fixed.steps == 10 and str(fixed) == "local:10"
    auto = parse_task(" LOCAL:auto ", slot_s=2.0, max_steps=50)
    assert auto.auto and str(auto) == "local:auto" and auto.slot_s == 2.0 and auto.max_steps == 50


@pytest.mark.parametrize("text", ["", "local", "local:", "local:0", "local:-3", "local:1.5",
                                  "local:10001", "sgd:3", "gradient:2", "local:autox"])
def test_parse_task_refuses_in_one_line(text):
    with pytest.raises(ConfigError) as exc:
        parse_task(text)
    assert "--task" in one_line(exc)


def test_parse_task_refuses_bad_bounds():
    with pytest.raises(ConfigError):
        parse_task("local:auto", max_steps=1, min_steps=2)
    with pytest.raises(ConfigError):
        parse_task("local:auto", slot_s=0)


# H sizing ----------------------------------------------------------------------------------------


def test_fixed_steps_ignore_speed():
    mode = parse_task("local:10")
    assert mode.steps_for(None, 32) == mode.steps_for(1e-6, 32) == mode.steps_for(1.0, 32) == 10
    assert mode.slot_samples(0.5, 32) == 320


def test_auto_steps_give_every_worker_the_same_slot_time():
    mode = parse_task("local:auto", slot_s=4.0, max_steps=500)
    batch = 32
    for s_per_sample in (1e-3, 3e-3, 1e-2):
        steps = mode.steps_for(s_per_sample, batch)
        assert steps * batch * s_per_sample == pytest.approx(4.0, rel=0.05)
    fast, slow = mode.steps_for(1e-3, batch), mode.steps_for(1e-2, batch)
    assert fast == pytest.approx(10 * slow, rel=0.05)


def test_auto_steps_are_bounded_and_start_at_the_low_end():
    mode = parse_task("local:auto", slot_s=4.0, min_steps=2, max_steps=100)
    assert mode.steps_for(1e-9, 32) == 100  # a very fast worker: capped
    assert mode.steps_for(10.0, 32) == 2  # a very slow one: at least the floor
    assert mode.steps_for(None, 32) == 64  # unmeasured: a first slot worth its download
    assert mode.steps_for(None, 32, link_s=5.0) == 64  # the link alone says nothing of compute
    assert parse_task("local:auto", max_steps=10).steps_for(None, 32) == 10
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert 2 <= mode.steps_for(bad, 32) <= 100
        assert 2 <= mode.steps_for(bad, 32, link_s=bad) <= 100


def test_auto_computes_link_factor_times_the_link_time():
    mode = parse_task("local:auto", slot_s=1.0, max_steps=1000, link_factor=3.0)
    step_s = 1e-3 * 32
    # a slow link: 2 s of transfers per slot call for 6 s of compute, 187.5 -> 188 steps
    assert mode.steps_for(1e-3, 32, link_s=2.0) == 188
    assert 188 * step_s >= 3 * 2.0
    # a fast link: the least compute time decides, 31.25 -> 32 steps
    assert mode.steps_for(1e-3, 32, link_s=0.1) == mode.steps_for(1e-3, 32) == 32
    # a worker twice as fast on the same link takes twice the steps: the same wall time
    assert mode.steps_for(0.5e-3, 32, link_s=2.0) == 375
    # the cap: too few outer steps otherwise
    assert mode.steps_for(1e-3, 32, link_s=100.0) == 1000
    for bad in (None, -1.0, float("nan"), float("inf")):
        assert mode.steps_for(1e-3, 32, link_s=bad) == 32
    assert parse_task("local:auto", slot_s=1.0, link_factor=0.0).steps_for(
        1e-3, 32, link_s=2.0) == 32  # factor 0: compute time only, as before the link counted
    assert parse_task("local:10", link_factor=3.0).steps_for(1e-3, 32, link_s=2.0) == 10


def test_link_factor_must_be_a_non_negative_number():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            parse_task("local:auto", link_factor=bad)


def test_inner_steps_of_a_short_slot():
    assert inner_steps(320, 32) == 10
    assert inner_steps(321, 32) == 11  # a partial last step, never smaller ones
    assert inner_steps(5, 32) == 1
    assert inner_steps(0, 32) == 1


# refused combinations ----------------------------------------------------------------------------


def test_local_refuses_gradient_coding_adaptive_and_sync_in_one_line():
    mode = parse_task("local:10")
    for text, sync, word in (("cyclic:1", False, "cyclic"), ("adaptive", False, "adaptive"),
                             ("none", True, "--sync")):
        with pytest.raises(ConfigError) as exc:
            check_redundancy(mode, parse_redundancy(text), sync)
        assert word in one_line(exc)
    check_redundancy(mode, parse_redundancy("replicate:2"))  # replication is fine
    check_redundancy(mode, Redundancy())
    check_redundancy(parse_task("gradient"), parse_redundancy("cyclic:2"), True)  # not local


# the outer step ----------------------------------------------------------------------------------


def reference_outer(params, changes, samples, staleness, lr, momentum, rule):
    """Nesterov SGD written out by hand, on plain Python floats: for each round,
    g = w(tau) * change / samples, v = m v + g, p -= lr * (g + m v)."""
    p = [float(x) for x in params]
    v = [0.0] * len(p)
    for change, n, tau in zip(changes, samples, staleness):
        w = rule.weight(tau)
        g = [w * float(c) / n for c in change]
        v = [momentum * vi + gi for vi, gi in zip(v, g)]
        p = [pi - lr * (gi + momentum * vi) for pi, gi, vi in zip(p, g, v)]
    return p


def test_outer_step_matches_a_plain_reference():
    torch.manual_seed(0)
    model = FlatModel(torch.nn.Linear(3, 2))
    start = model.params.clone()
    config = outer.OuterConfig(lr=0.7, momentum=0.9)
    rule = StalenessRule("inverse", 8)
    aggregator = Aggregator(model, outer.build(model.module.parameters(), config), rule)
    changes = [torch.randn(model.numel, dtype=torch.float64).float() for _ in range(4)]
    samples = [64, 32, 64, 96]
    versions = [0, 0, 1, 3]  # the round's planned version: staleness 0, 1, 1, 0
    taus = []
    for change, n, v in zip(changes, samples, versions):
        taus.append(aggregator.version - v)
        assert aggregator.apply(change.clone(), n, v) == rule.weight(taus[-1])
    expected = reference_outer(start, changes, samples, taus, 0.7, 0.9, rule)
    assert torch.allclose(model.params, torch.tensor(expected), atol=1e-5)
    assert aggregator.version == 4


def test_outer_lr_one_without_momentum_lands_on_the_workers_model():
    """Plain local SGD: a round of one slot moves the model to where the worker's steps ended."""
    model = FlatModel(torch.nn.Linear(4, 1))
    start = model.params.clone()
    worker_end = start + torch.linspace(-1, 1, model.numel)
    aggregator = Aggregator(model, outer.build(model.module.parameters(),
                                               outer.OuterConfig(lr=1.0, momentum=0.0)),
                            StalenessRule())
    samples = 48
    aggregator.apply((start - worker_end) * samples, samples, 0)
    assert torch.allclose(model.params, worker_end, atol=1e-6)


def test_outer_config_refuses_bad_values():
    with pytest.raises(ConfigError):
        outer.OuterConfig(lr=0)
    with pytest.raises(ConfigError):
        outer.OuterConfig(momentum=1.0)


# the worker's inner steps ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_built():
    return build(load_job("digits", {"hidden": 16, "batch_size": 8}), seed=0)


def reference_local(built, seed, params, part, steps):
    """H steps of the job's optimizer on a fresh copy of the model, the plain way."""
    module = built.job.build_model()
    torch.nn.utils.vector_to_parameters(params.clone(), module.parameters())
    optimizer = built.job.build_optimizer(module.parameters())
    epoch, offset, count = part
    indices = part_indices(seed, len(built.train), epoch, offset, count)
    for step in range(steps):
        chunk = indices[count * step // steps:count * (step + 1) // steps]
        optimizer.zero_grad()
        built.job.loss(module, gather(built.train, chunk)).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(module.parameters()).detach()


@pytest.mark.parametrize("micro_batch", [3, 64])  # micro-batches split a step, or hold several
def test_local_slot_is_h_steps_of_the_jobs_optimizer(digits_built, micro_batch):
    engine = Engine(digits_built, seed=5, device=torch.device("cpu"))
    engine.micro_batch = micro_batch
    engine._observe = lambda *a: None  # keep the micro-batch size fixed for the test
    params = digits_built.model.params.clone()
    kept = params.clone()
    part = [1, 16, 40]
    out = engine.compute(Work(7, 3, params, [part], [1.0], kind="local", steps=5),
                         threading.Event())
    end = reference_local(digits_built, 5, params, part, 5)
    assert out.slot == 7 and out.version == 3 and out.samples == 40
    assert torch.allclose(out.gradient, (params - end) * 40, atol=1e-4)
    assert torch.equal(params, kept)  # the worker's cached model is not what the steps moved
    again = engine.compute(Work(8, 3, params, [part], [1.0], kind="local", steps=5),
                           threading.Event())
    assert torch.equal(again.gradient, out.gradient)  # fresh inner state: replicas agree


@pytest.mark.parametrize("micro_batch", [3, 64])
def test_the_coordinators_local_change_matches_a_workers(digits_built, micro_batch):
    """The coordinator settles a disputed local slot with common.job.local_change: an honest
    worker's result (other micro-batches, so other rounding) matches it, a sign flip does not."""
    engine = Engine(digits_built, seed=5, device=torch.device("cpu"))
    engine.micro_batch = micro_batch
    engine._observe = lambda *a: None
    params = digits_built.model.params.clone()
    part = [2, 8, 40]
    worker = engine.compute(Work(1, 0, params, [part], [1.0], kind="local", steps=5),
                            threading.Event()).gradient
    scratch = FlatModel(digits_built.job.build_model())
    here = local_change(digits_built.job, scratch, params, digits_built.train, 5, part, 1.0,
                        5).change
    size = finite_norm(here)
    assert matches(distance([worker], [here]), size)
    assert not matches(distance([-worker], [here]), size)


def test_local_slot_cancel(digits_built):
    engine = Engine(digits_built, seed=5, device=torch.device("cpu"))
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        engine.compute(Work(1, 0, digits_built.model.params.clone(), [[0, 0, 40]], [1.0],
                            kind="local", steps=5), cancel)


# the wire ----------------------------------------------------------------------------------------


def test_task_kind_and_steps_round_trip_and_default_to_gradient():
    task = proto.Task(slot=1, round=1, version=2, parts=[[0, 0, 64]], coefficients=[1.0],
                      deadline_s=5.0, kind="local", steps=4)
    assert proto.decode(proto.encode(task)) == task
    plain = proto.Task(slot=1, round=1, version=2, parts=[[0, 0, 64]], coefficients=[1.0],
                       deadline_s=5.0)
    assert plain.kind == "gradient" and proto.decode(proto.encode(plain)).kind == "gradient"


@pytest.mark.parametrize("fields", [
    {"kind": "magic", "steps": 1},
    {"kind": "local", "steps": 0},
    {"kind": "local", "steps": -1},
    {"kind": "local", "steps": 2, "parts": [[0, 0, 8], [0, 8, 8]], "coefficients": [1.0, 1.0]},
])
def test_bad_local_tasks_are_protocol_errors(fields):
    base = dict(slot=1, round=1, version=0, parts=[[0, 0, 8]], coefficients=[1.0], deadline_s=1.0)
    frames = proto.encode(proto.Task(**{**base, **fields}))
    with pytest.raises(ProtocolError):
        proto.decode(frames)


# rounds sized per worker -------------------------------------------------------------------------


def test_rounds_are_sized_for_the_worker_that_opens_them():
    mode = parse_task("local:auto", slot_s=1.0, min_steps=1, max_steps=100)
    s = Dealing(Scheduler(SchedulerConfig(batch_size=8), Sampler(100_000, None), task_mode=mode))
    for worker in ("fast", "slow"):
        s.join(worker, {}, 0.0)
    first = [a for a in s.ready("fast", 1, 0.0) + s.ready("slow", 1, 0.0) if isinstance(a, Assign)]
    assert [sum(p[2] for p in a.parts) for a in first] == [512, 512]  # 64 steps, unmeasured
    assert [(a.kind, a.steps) for a in first] == [("local", 64)] * 2
    sizes, steps = {}, {}
    for a in first:
        per_sample = 1e-3 if a.worker == "fast" else 1e-2
        # arriving the moment its compute ends: a link that costs nothing
        ok, actions = s.result(a.worker, a.slot, per_sample * 512, per_sample * 512)
        assert ok
        assert s.workers[a.worker].link_s == 0.0
        actions += s.applied(s.version + 1, 1.0)
        for b in actions:
            if isinstance(b, Assign):
                sizes[b.worker] = sum(p[2] for p in b.parts)
                steps[b.worker] = b.steps
    # one second of compute each: 125 steps capped at 100 for the fast one, 12.5 -> 13 steps
    # (at least the slot's time)
    assert sizes == {"fast": 100 * 8, "slow": 13 * 8}
    assert steps == {"fast": 100, "slow": 13}


def test_a_local_slot_tells_its_kind_and_steps_and_an_epochs_short_end_takes_fewer():
    s = Dealing(Scheduler(SchedulerConfig(batch_size=8, partitions=2), Sampler(100, 1),
                  task_mode=parse_task("local:5")))  # rounds of 2 x 40 samples; 20 left at the end
    s.join("w", {}, 0.0)
    (a, b) = [x for x in s.ready("w", 2, 0.0) if isinstance(x, Assign)]
    assert (a.kind, a.steps, b.kind, b.steps) == ("local", 5, "local", 5)
    assert s.slot_work(a.slot) == SlotWork(0, [list(a.parts[0])], [1.0], "local", 5)
    assert [(x.kind, x.steps) for x in s.resend("w", 0.5)] == [("local", 5)] * 2
    actions = s.result("w", a.slot, 1.0, 1.0)[1]  # the next round opens on the freed credit
    actions += s.result("w", b.slot, 1.0, 1.0)[1] + s.applied(1, 1.0)
    last = [x for x in actions if isinstance(x, Assign)]
    assert [sum(p[2] for p in x.parts) for x in last] == [10, 10]
    assert {(x.kind, x.steps) for x in last} == {("local", 2)}  # 10 samples: 2 steps, 8 and 2


def test_a_late_local_slots_duplicate_is_the_same_task():
    s = Dealing(Scheduler(SchedulerConfig(batch_size=8, partitions=2, open_rounds=1, speculate=True,
                                  spec_min_results=1, spec_floor_s=0.0, min_deadline_s=1000.0,
                                  heartbeat_s=1000.0),
                  Sampler(1000, None), task_mode=parse_task("local:5")))
    s.join("fast", {}, 0.0)
    s.join("slow", {}, 0.0)
    (mine,) = [x for x in s.ready("fast", 1, 0.0) if isinstance(x, Assign)]
    (late,) = [x for x in s.ready("slow", 1, 0.0) if isinstance(x, Assign)]
    s.result("fast", mine.slot, 1.0, 1.0)  # 1/40 s per sample: slow's slot is late after 1 s
    (copy,) = [x for x in s.tick(5.0) if isinstance(x, Assign)]
    assert copy.worker == "fast" and copy.parts == late.parts and copy.slot != late.slot
    assert (copy.kind, copy.steps) == ("local", 5)
    assert (s.slot_work(copy.slot).kind, s.slot_work(copy.slot).steps) == ("local", 5)


def test_a_gradient_slot_has_no_inner_steps():
    s = Dealing(Scheduler(SchedulerConfig(batch_size=8), Sampler(100, None)))
    s.join("w", {}, 0.0)
    (a,) = [x for x in s.ready("w", 1, 0.0) if isinstance(x, Assign)]
    assert (a.kind, a.steps) == ("gradient", 0)
    assert s.slot_work(a.slot).kind == "gradient" and s.slot_work(a.slot).steps == 0
    assert [(x.kind, x.steps) for x in s.resend("w", 1.0)] == [("gradient", 0)]


def test_the_scheduler_refuses_what_local_tasks_cannot_decode():
    with pytest.raises(ConfigError) as info:
        Dealing(Scheduler(SchedulerConfig(batch_size=8, redundancy=Redundancy("cyclic", 1)),
                  Sampler(100, None), task_mode=parse_task("local:5")))
    assert "cyclic" in one_line(info)


# wire economy: bfloat16 results with error feedback ------------------------------------------------


def test_float32_results_travel_untouched():
    from idlegrad.worker.compress import ErrorFeedback

    change = torch.randn(100)
    assert ErrorFeedback("float32").encode(change) is change


def test_bfloat16_with_error_feedback_tracks_the_true_sum():
    from idlegrad.worker.compress import ErrorFeedback

    torch.manual_seed(1)
    wire = ErrorFeedback("bfloat16")
    # a small steady drift under noise: plain rounding loses the drift, feedback keeps it
    changes = [1.0 + 1e-3 + 1e-4 * torch.randn(1000) for _ in range(200)]
    sent = [wire.encode(c) for c in changes]
    assert all(s.dtype == torch.bfloat16 for s in sent)
    true_sum = torch.stack(changes).sum(0)
    fed_back = torch.stack([s.float() for s in sent]).sum(0)
    plain = torch.stack([c.to(torch.bfloat16).float() for c in changes]).sum(0)
    one_rounding = 2 ** -8 * 1.01  # bfloat16's spacing just above 1
    assert (fed_back - true_sum).abs().max() <= one_rounding
    assert (plain - true_sum).abs().max() > 10 * one_rounding  # what the feedback prevents
    assert torch.allclose(wire.residual, true_sum - fed_back, atol=1e-4)


def test_unknown_result_dtype():
    from idlegrad.worker.compress import ErrorFeedback

    with pytest.raises(ValueError):
        ErrorFeedback("int4")
    welcome = proto.Welcome(job="digits", job_args={}, fingerprint="f", seed=0, heartbeat_s=1.0,
                            liveness=3, result_dtype="int4")
    with pytest.raises(ProtocolError):
        proto.decode(proto.encode(welcome))
    ok = dict(welcome.__dict__, result_dtype="bfloat16")
    assert proto.decode(proto.encode(proto.Welcome(**ok))).result_dtype == "bfloat16"


# checkpoints across task kinds ---------------------------------------------------------------------


def test_a_checkpoint_resumes_across_task_kinds_without_mixing_optimizer_state(tmp_path):
    from idlegrad.coordinator.server import Coordinator, CoordinatorConfig

    ckpt = str(tmp_path / "ckpt")
    config = dict(job="digits", job_args={"hidden": 8}, checkpoint_dir=ckpt, threads=1)

    def model_of(**extra):
        return Coordinator(CoordinatorConfig(**config, **extra)).training.model

    first = Coordinator(CoordinatorConfig(**config))  # gradient tasks: the job's Adam
    first.training.model.model.params.add_(0.5)
    first.save_checkpoint()
    second_coordinator = Coordinator(CoordinatorConfig(
        **config, task="local:4", outer=outer.OuterConfig(lr=0.8, momentum=0.5)))
    second = second_coordinator.training.model
    assert torch.equal(second.model.params, first.training.model.model.params)
    assert isinstance(second.optimizer, torch.optim.SGD)
    group = second.optimizer.param_groups[0]
    assert group["lr"] == 0.8 and group["momentum"] == 0.5  # not Adam's lr from the checkpoint
    second.aggregator.apply(torch.ones(second.model.numel), 1, 0)  # momentum state to carry
    second_coordinator.save_checkpoint()
    third = model_of(task="local:auto", outer=outer.OuterConfig(lr=0.8, momentum=0.5))
    assert third.optimizer.state_dict()["state"]  # same kind: the outer momentum is carried
    fourth = model_of()
    assert isinstance(fourth.optimizer, torch.optim.Adam) and not fourth.optimizer.state_dict()["state"]


def test_link_time_is_wall_time_less_compute_and_queue_wait_of_slots_with_a_model():
    mode = parse_task("local:auto", slot_s=0.1, min_steps=1, max_steps=10_000, link_factor=3.0)
    s = Dealing(Scheduler(SchedulerConfig(batch_size=8), Sampler(1_000_000, None), task_mode=mode))
    s.join("w", {}, 0.0)
    first, second = [a for a in s.ready("w", 2, 0.0) if isinstance(a, Assign)]
    assert first.send_model and not second.send_model  # one round's version: one download
    # sent at 0; 2 s down, 1 s compute, 2 s up
    ok, _ = s.result("w", first.slot, 1.0, 5.0, waited_s=0.0)
    assert ok and s.workers["w"].link_s == pytest.approx(4.0)
    # queued behind the first: its wait is not link time, and it came without a model anyway
    ok, actions = s.result("w", second.slot, 1.0, 6.0, waited_s=3.0)
    assert ok and s.workers["w"].link_s == pytest.approx(4.0)
    assert s.workers["w"].s_per_sample == pytest.approx(1.0 / 512)
    actions += s.applied(s.version + 1, 6.0)
    nxt, _ = [a for a in actions if isinstance(a, Assign)]
    # 3 x 4 s of compute at 1/512 s per sample: 6144 samples, 768 steps of 8
    assert nxt.send_model and sum(p[2] for p in nxt.parts) == 768 * 8
    # a misreported time (the result before its own compute) is not a reading
    ok, _ = s.result("w", nxt.slot, 100.0, 7.0)
    assert ok and list(s.workers["w"].speed.link_times) == [pytest.approx(4.0)]


def test_result_carries_its_queue_wait():
    blob = proto.Blob("float32", 2, [b"\0" * 8])
    result = proto.Result(slot=1, version=0, samples=8, loss=0.5, compute_s=1.0, gradient=blob,
                          waited_s=2.5)
    assert proto.decode(proto.encode(result)).waited_s == 2.5
    old = proto.Result(slot=1, version=0, samples=8, loss=0.5, compute_s=1.0, gradient=blob)
    assert proto.decode(proto.encode(old)).waited_s == 0.0
    bad = proto.Result(slot=1, version=0, samples=8, loss=0.5, compute_s=1.0, gradient=blob,
                       waited_s=-1.0)
    with pytest.raises(ProtocolError):
        proto.decode(proto.encode(bad))
