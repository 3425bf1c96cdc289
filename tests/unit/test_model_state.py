"""Model state beyond parameters (buffers) and the job's recipes (schedule, clipping, named
optimizer groups, autocast, collate): the pieces, and the round core applying them with the
coordinator's real model backend whatever the code."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from torch import nn

from idlegrad.common import protocol as proto
from idlegrad.common.builtin_jobs import classification_loss, digits, mlp
from idlegrad.common.coding import parse_redundancy
from idlegrad.common.errors import JobError, ProtocolError
from idlegrad.common.job import (FlatModel, Job, accumulate_coded_gradient, autocast_for, build,
                                 build_schedule, gather, make_optimizer)
from idlegrad.common.tensors import buffer_vector, to_blob
from idlegrad.coordinator import checkpoint
from idlegrad.coordinator.aggregator import merge_buffers
from idlegrad.coordinator.staleness import StalenessRule
from idlegrad.coordinator.config import CoordinatorConfig, check
from idlegrad.coordinator.effects import Applied
from idlegrad.coordinator.model_state import ModelState
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import Assign, Scheduler, SchedulerConfig
from idlegrad.coordinator.training import Training
from idlegrad.coordinator.trust import TrustConfig, TrustPolicy


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.register_buffer("mask", torch.ones(5), persistent=False)  # derived: never travels
        self.register_buffer("flags", torch.tensor([True, False]))


# buffers -------------------------------------------------------------------------------------


def test_persistent_buffers_read_and_load_as_one_float64_vector():
    model = FlatModel(WithBuffers())
    assert [name for name, _ in model.buffers] == [
        "flags", "body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"]
    assert model.buffer_numel == 2 + 4 + 4 + 1
    assert model.counter_mask.tolist() == [True, True] + [False] * 8 + [True]
    flat = model.buffers_flat()
    assert flat.dtype == torch.float64 and flat.tolist() == [1, 0] + [0] * 4 + [1] * 4 + [0]
    other = FlatModel(WithBuffers())
    new = torch.arange(11, dtype=torch.float64) + 0.25
    new[0], new[1], new[-1] = 0, 1, 7.0
    other.load_buffers(new)
    assert other.buffers_flat().tolist() == new.tolist()
    assert other.module.body[1].num_batches_tracked.dtype == torch.int64
    assert other.module.flags.tolist() == [False, True]
    restored = FlatModel(WithBuffers())
    assert restored.load_buffer_state(other.buffer_state()) == []
    assert restored.buffers_flat().tolist() == new.tolist()


def test_parameters_of_mixed_dtypes_are_refused_naming_the_parameter():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module[1].half()
    with pytest.raises(JobError, match=r"parameter '1.weight' is float16, while '0.weight' is "
                                       r"float32"):
        FlatModel(module)


def test_a_model_without_buffers_keeps_its_fingerprint_and_one_with_them_names_them():
    plain, normed = build(digits()), build(digits(norm="batch"))
    assert plain.model.buffers == []
    identity = {"name": "digits", "params": plain.model.layout(), "train": len(plain.train),
                "test": len(plain.test)}  # the fingerprint's content before buffers travelled
    assert plain.fingerprint == hashlib.sha256(
        json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    assert normed.fingerprint != build(digits(hidden=128)).fingerprint
    assert normed.model.buffer_layout()[0] == ["1.running_mean", [128], "float32"]


def test_merged_buffers_are_a_sample_weighted_mean_taken_by_the_staleness_weight():
    current = torch.tensor([0.0, 1.0, 5.0], dtype=torch.float64)
    counters = torch.tensor([False, False, True])
    a = torch.tensor([2.0, 3.0, 7.0], dtype=torch.float64)
    b = torch.tensor([4.0, 1.0, 6.0], dtype=torch.float64)
    fresh = merge_buffers(current, [(a, 8), (b, 24)], 1.0, counters)
    assert fresh.tolist() == [3.5, 1.5, 7.0]  # (2*8 + 4*24)/32; counter: the largest
    stale = merge_buffers(current, [(a, 8), (b, 24)], 0.5, counters)
    assert stale.tolist() == [1.75, 1.25, 7.0]
    behind = merge_buffers(torch.tensor([0.0, 0.0, 9.0], dtype=torch.float64), [(a, 1)], 1.0,
                           counters)
    assert behind[2] == 9.0  # a counter never goes back
    assert merge_buffers(current, [(a, 0), (b, 0)], 1.0, counters)[0] == 3.0  # no samples: equal


@pytest.mark.parametrize("blob, reason", [
    (to_blob(torch.zeros(11, dtype=torch.float32)), "dtype"),
    (to_blob(torch.zeros(10, dtype=torch.float64)), "elements"),
    (to_blob(torch.tensor([0.0] * 5 + [math.nan] + [0.0] * 5, dtype=torch.float64)), "finite"),
    (to_blob(torch.tensor([0.5] + [0.0] * 10, dtype=torch.float64)), "whole"),
    (to_blob(torch.tensor([0.0] * 10 + [2.0 ** 60], dtype=torch.float64)), "whole"),
])
def test_a_buffer_frame_is_checked(blob, reason):
    model = FlatModel(WithBuffers())
    with pytest.raises(ProtocolError, match=reason):
        buffer_vector(blob, model.buffer_numel, model.counter_mask)


def test_a_result_without_the_buffers_of_a_model_that_has_some_is_malformed():
    built = build(digits(norm="batch"))
    state = ModelState(built, torch.optim.SGD(built.model.module.parameters(), lr=0.1),
                       StalenessRule(), 0)
    with pytest.raises(ProtocolError, match="no buffers"):
        state.buffers_of(None)
    plain = build(digits())
    with pytest.raises(ProtocolError, match="none"):
        ModelState(plain, torch.optim.SGD(plain.model.module.parameters(), lr=0.1),
                   StalenessRule(), 0).buffers_of(to_blob(torch.zeros(3, dtype=torch.float64)))


def test_buffers_travel_in_tasks_and_results():
    buffers = to_blob(torch.arange(4, dtype=torch.float64))
    result = proto.Result(slot=1, version=0, samples=1, loss=0.0, compute_s=0.0,
                          gradient=to_blob(torch.ones(3)), buffers=buffers)
    decoded = proto.decode([bytes(f) for f in proto.encode(result)])
    assert torch.frombuffer(decoded.buffers.frames[0], dtype=torch.float64).tolist() == [0, 1, 2, 3]
    task = proto.Task(slot=1, round=1, version=0, parts=[[0, 0, 1]], coefficients=[1.0],
                      deadline_s=1.0, model=to_blob(torch.ones(3)), buffers=buffers)
    assert proto.decode([bytes(f) for f in proto.encode(task)]).buffers.numel == 4


# recipes -------------------------------------------------------------------------------------


def test_build_optimizer_taking_named_parameters_gets_names_and_the_old_signature_works():
    module = mlp([4, 3, 2], batch_norm=True)
    seen = []

    def named(named_parameters):
        seen.extend(name for name, _ in named_parameters)
        return torch.optim.SGD([p for _, p in named_parameters], lr=0.1)

    job = Job("j", lambda: module, lambda: ([], []), classification_loss, named, 4)
    make_optimizer(job, module)
    assert seen == [name for name, _ in module.named_parameters()]
    old = Job("j", lambda: module, lambda: ([], []), classification_loss,
              lambda params: torch.optim.SGD(params, lr=0.1), 4)
    assert isinstance(make_optimizer(old, module), torch.optim.SGD)
    decayed = make_optimizer(digits(weight_decay=0.1), module)
    groups = {g["weight_decay"]: sum(p.numel() for p in g["params"])
              for g in decayed.param_groups}
    assert groups == {0.1: 4 * 3 + 3 * 2, 0.0: 3 + 3 + 3 + 2}  # no decay on biases and norms


def test_a_collate_makes_batches_the_default_cannot():
    samples = [{"text": "ab"}, {"text": "cde"}]
    lengths = lambda items: torch.tensor([len(s["text"]) for s in items])  # noqa: E731
    assert gather(samples, [1, 0], lengths).tolist() == [3, 2]


def test_bf16_autocast_leaves_the_cpu_path_unchanged():
    job = digits()
    built = build(job)
    mixed = build(Job(**{**job.__dict__, "mixed_precision": "bf16"}))
    assert type(autocast_for(mixed.job, "cpu")).__name__ == "nullcontext"
    for b in (built, mixed):
        b.model.grads.zero_()
        accumulate_coded_gradient(b.job, b.model, b.train, 0, [[0, 0, 16]], [1.0])
    assert torch.equal(built.model.grads, mixed.model.grads)
    with pytest.raises(JobError, match="mixed_precision"):
        build(Job(**{**job.__dict__, "mixed_precision": "fp8"}))


def lr_sequence(training: Training, steps: int) -> list[float]:
    """Apply `steps` rounds (a fixed gradient) to the coordinator's model; the learning rate
    after each."""
    model = training.model
    gradient = torch.full((model.model.numel,), 0.01)
    out = []
    for _ in range(steps):
        model.apply([([gradient], 1.0)], [1.0], 1, model.version, lambda v: False)
        out.append(model.optimizer.param_groups[0]["lr"])
    return out


def test_a_resumed_run_continues_the_learning_rate_schedule_exactly(tmp_path):
    args = {"warmup": 3, "schedule_steps": 12}

    def training(directory):
        config = CoordinatorConfig(job="digits", job_args=dict(args),
                                   checkpoint_dir=str(tmp_path / directory))
        return Training(config, check(config))

    whole = training("whole")
    uninterrupted = lr_sequence(whole, 10)
    first = training("resumed")
    before = lr_sequence(first, 4)
    first.save_checkpoint(0.0)
    again = training("resumed")  # a new process would build the same from the checkpoint
    after = lr_sequence(again, 6)
    assert before + after == uninterrupted
    assert len(set(uninterrupted)) == 9  # warm-up, then cosine: one rate twice (the peak)
    assert torch.equal(again.model.model.params, whole.model.model.params)


def test_a_torch_scheduler_is_checkpointed_and_resumed(tmp_path):
    job = Job(**{**digits().__dict__, "build_scheduler":
                 lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7)})

    def state_of():
        built = build(job)
        optimizer = make_optimizer(job, built.model.module)
        return ModelState(built, optimizer, StalenessRule(), 0,
                          schedule=build_schedule(job, optimizer))

    def steps(model, n):
        gradient = torch.full((model.model.numel,), 0.01)
        out = []
        for _ in range(n):
            model.apply([([gradient], 1.0)], [1.0], 1, model.version, lambda v: False)
            out.append(model.optimizer.param_groups[0]["lr"])
        return out

    whole = steps(state_of(), 9)
    first = state_of()
    head = steps(first, 5)
    checkpoint.save(str(tmp_path), first.state())
    resumed = state_of()
    resumed.load(checkpoint.load(str(tmp_path)), with_optimizer=True)
    assert head + steps(resumed, 4) == whole


# the round core with the real backend, whatever the code ----------------------------------------


def run_round(code: str, clip: float | None, partitions: int = 4) -> tuple[ModelState, Applied]:
    """One synchronous round of the BatchNorm digits job under `code`, every slot computed with
    the workers' kernel from the snapshot it was sent; the model after the round."""
    job = Job(**{**digits(norm="batch").__dict__, "clip_norm": clip})
    built = build(job)
    optimizer = make_optimizer(job, built.model.module)
    model = ModelState(built, optimizer, StalenessRule(), 0, clip_norm=clip)
    scheduler = Scheduler(SchedulerConfig(batch_size=32, partitions=partitions, open_rounds=1,
                                          redundancy=parse_redundancy(code)),
                          Sampler(len(built.train), None))
    core = RoundCore(scheduler, model, TrustPolicy(TrustConfig()))
    worker = FlatModel(job.build_model())
    tasks = []
    for i in range(8):
        core.join(f"w{i}", {}, f"w{i}", 0.0)
        tasks += [a for a in core.ready(f"w{i}", 1, 0.0) if isinstance(a, Assign)]
    for task in tasks:
        model.blob(task.version)
        worker.load(model._snapshots[task.version][0])
        worker.load_buffers(model._buffer_snapshots[task.version][0])
        worker.grads.zero_()
        accumulate_coded_gradient(job, worker, built.train, 0, task.parts, task.coefficients)
        out = core.result(task.worker, task.slot, [worker.grads.clone()],
                          float(worker.grads.norm()), 0.1, 1.0, samples=1,
                          buffers=worker.buffers_flat())
        applied = [e for e in out if isinstance(e, Applied)]
        if applied:
            return model, applied[0]
    raise AssertionError(f"{code}: the round did not decode")


def test_clipping_applies_to_the_decoded_round_the_same_whatever_the_code():
    unclipped, _ = run_round("none", None)
    results = {code: run_round(code, 0.5)[0] for code in ("none", "replicate:2", "cyclic:1")}
    reference = results["none"].model.params
    for code, model in results.items():
        assert model.aggregator.clipped == 1, code
        assert torch.allclose(model.model.params, reference, atol=1e-6), code
    assert not torch.allclose(unclipped.model.params, reference, atol=1e-4)


def test_buffers_of_a_round_merge_by_the_same_rule_whatever_the_code():
    merged = {code: run_round(code, None)[0].model for code in ("none", "replicate:2",
                                                                "cyclic:1")}
    # each partition's slot ran one forward pass from the round's buffers; replicas ran the same
    assert torch.equal(merged["none"].buffers_flat(), merged["replicate:2"].buffers_flat())
    none, cyclic = merged["none"].module[1], merged["cyclic:1"].module[1]
    assert int(none.num_batches_tracked) == 1
    assert int(cyclic.num_batches_tracked) == 2  # a cyclic slot passes over its two parts
    # from zero, one pass leaves momentum (0.1) times a batch mean, two about 0.19 times
    ratio = float(cyclic.running_mean.norm() / none.running_mean.norm())
    assert bool((none.running_mean != 0).any()) and 1.6 < ratio < 2.2, ratio
