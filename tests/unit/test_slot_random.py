"""Randomness inside a slot (common/slot_random.py): a slot of a job with dropout computed by a
worker and computed again by the coordinator, to check it, draws the same masks, whatever
micro-batches the worker's speed picks; other slots draw others; torch's generators outside a
slot are left alone; and whether a job draws randomness is found at build, on every side."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from idlegrad.common import protocol as proto
from idlegrad.common.builtin_jobs import digits
from idlegrad.common.errors import ProtocolError
from idlegrad.common.job import build, coded_gradient, job_differences
from idlegrad.coordinator.effects import Compute
from idlegrad.coordinator.model_state import ModelState
from idlegrad.coordinator.slots import SlotWork
from idlegrad.coordinator.staleness import StalenessRule
from idlegrad.coordinator.trust import matches
from idlegrad.worker.engine import Engine, Work

SEED = 5
VERSION = 3
PARTS = [[0, 10, 150], [1, 0, 70]]
COEFFICIENTS = [1.0, -0.5]


def dropout_job(p: float = 0.5):
    """The digits job with a Dropout on its hidden layer, built here (not a job argument); before
    the ReLU, so that a unit is zero exactly when it is dropped."""
    return dataclasses.replace(digits(hidden=32), build_model=lambda: nn.Sequential(
        nn.Linear(64, 32), nn.Dropout(p), nn.ReLU(), nn.Linear(32, 10)))


def worker_gradient(job, work: Work, micro_batch: int, monkeypatch) -> torch.Tensor:
    """The slot as a worker computes it: its engine, in micro-batches its speed would pick."""
    engine = Engine(build(job), seed=SEED, device=torch.device("cpu"))
    engine.micro_batch = micro_batch
    monkeypatch.setattr(engine, "_observe", lambda *a: None)
    return engine.compute(work, threading.Event()).gradient.clone()


def coordinator_gradient(job, kind: str = "gradient", steps: int = 0,
                         parts=PARTS, coefficients=COEFFICIENTS) -> tuple[torch.Tensor, ModelState]:
    """The slot as the coordinator computes it to settle a doubt about it (ModelState's
    `computation`, what verify.py's Compute runs)."""
    built = build(job)
    state = ModelState(built, torch.optim.SGD(built.model.module.parameters(), lr=0.1),
                       StalenessRule(), SEED, version=VERSION)
    request = Compute(slot=9, work=SlotWork(VERSION, parts, coefficients, kind, steps))
    (result,) = state.computation(request)()
    return result, state


def test_a_dropout_slot_recomputed_by_the_coordinator_matches_the_workers_bit_for_bit(
        monkeypatch):
    job = dropout_job()
    expected, state = coordinator_gradient(job)
    params = state.model.params.detach().clone()
    for micro_batch in (7, 64, 1000):  # a slow worker, a middling one, a fast one
        got = worker_gradient(job, Work(slot=4, version=VERSION, params=params, parts=PARTS,
                                        coefficients=COEFFICIENTS), micro_batch, monkeypatch)
        off = float(torch.linalg.vector_norm(got - expected))
        assert matches(off, float(torch.linalg.vector_norm(expected))), (micro_batch, off)
        assert torch.equal(got, expected), micro_batch


def test_a_local_dropout_slot_recomputed_by_the_coordinator_matches_the_workers(monkeypatch):
    job = dropout_job()
    part, coefficient = [[0, 30, 96]], [1.0]
    expected, state = coordinator_gradient(job, "local", 4, part, coefficient)
    params = state.model.params.detach().clone()
    got = worker_gradient(job, Work(slot=4, version=VERSION, params=params, parts=part,
                                    coefficients=coefficient, kind="local", steps=4), 5,
                          monkeypatch)
    assert torch.equal(got, expected)


def masks_drawn(built, parts, version: int, block) -> list[torch.Tensor]:
    """The dropout masks a slot's computation draws, one row per sample, in part order."""
    dropout = next(m for m in built.model.module.modules() if isinstance(m, nn.Dropout))
    masks: list[torch.Tensor] = []
    handle = dropout.register_forward_hook(lambda m, inputs, out: masks.append(out != 0))
    try:
        coded_gradient(built.job, built.model, built.model.params.detach().clone(), built.train,
                       SEED, parts, [1.0] * len(parts), version=version, block=block)
    finally:
        handle.remove()
    return masks


def test_other_slots_draw_other_masks_and_a_part_shared_by_two_slots_draws_the_same():
    built = build(dropout_job())
    assert built.random_block == 64
    first = torch.cat(masks_drawn(built, [[0, 0, 64]], VERSION, built.random_block))
    second = torch.cat(masks_drawn(built, [[0, 64, 64]], VERSION, built.random_block))
    later = torch.cat(masks_drawn(built, [[0, 0, 64]], VERSION + 1, built.random_block))
    next_epoch = torch.cat(masks_drawn(built, [[1, 0, 64]], VERSION, built.random_block))
    for other in (second, later, next_epoch):
        assert not torch.equal(first, other)
    # a coded slot holding that part as its second draws the part's masks for it
    coded = masks_drawn(built, [[0, 64, 64], [0, 0, 64]], VERSION, built.random_block)
    assert torch.equal(torch.cat(coded[1:]), first)
    # and about half the units are dropped (p = 0.5): they are real draws
    assert 0.4 < float(first.float().mean()) < 0.6


def test_a_slot_leaves_torchs_generator_where_it_was(monkeypatch):
    job = dropout_job()
    built = build(job)
    params = built.model.params.detach().clone()
    torch.manual_seed(11)
    untouched = torch.rand(4)
    torch.manual_seed(11)
    worker_gradient(job, Work(slot=1, version=0, params=params, parts=PARTS,
                              coefficients=COEFFICIENTS), 16, monkeypatch)
    assert torch.equal(torch.rand(4), untouched)


class Augmented(Dataset):
    """A training set whose samples are augmented with torch's generator, or Python's."""

    def __init__(self, base, generator: str):
        self.base, self.generator = base, generator

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        noise = torch.rand(()) if self.generator == "torch" else random.random()
        return x + 0.01 * noise, y


def with_augmentation(generator: str):
    job = digits(hidden=8)

    def build_datasets():
        train, test = job.build_datasets()
        return Augmented(train, generator), test

    return dataclasses.replace(job, build_datasets=build_datasets)


def test_whether_a_job_draws_randomness_is_found_at_build_and_is_in_its_fingerprint():
    plain = build(digits(hidden=32))
    assert plain.random_block is None and "random_block" not in plain.identity
    with_dropout = build(dropout_job())
    assert with_dropout.random_block == 64 and with_dropout.fingerprint != plain.fingerprint
    drops_nothing = build(dropout_job(p=0.0))
    assert drops_nothing.random_block is None
    assert build(with_augmentation("torch")).random_block == 64  # found by the probe
    # Python's generator is not torch's: not seen, and not seeded (the docs say so)
    assert build(with_augmentation("python")).random_block is None
    # the job's own word decides, and sets the block
    declared = dataclasses.replace(dropout_job(), draws_randomness=False)
    assert build(declared).random_block is None
    sized = dataclasses.replace(with_augmentation("python"), draws_randomness=True,
                                random_block=16)
    assert build(sized).random_block == 16
    # a worker that would cut other micro-batches is told what differs
    said = job_differences(with_dropout.identity, drops_nothing.identity, "here",
                           "at the coordinator")
    assert said == ["micro-batches of 64 (randomness) here, free micro-batches at the "
                    "coordinator"], said
    # and it travels in the identity a peer reads, schema-checked
    proto.check_job_identity(with_dropout.identity, "welcome.job_identity")
    for bad in ("64", 0, 2**40, True):
        with pytest.raises(ProtocolError, match="random_block"):
            proto.check_job_identity({**with_dropout.identity, "random_block": bad}, "welcome")


def test_the_probe_leaves_batchnorm_statistics_and_the_generator_alone():
    job = dataclasses.replace(digits(hidden=8, norm="batch"), draws_randomness=None)
    torch.manual_seed(2)
    untouched = torch.rand(3)
    torch.manual_seed(2)
    built = build(job)
    assert torch.equal(torch.rand(3), untouched)
    fresh = job.build_model()
    for (name, b), (_, expected) in zip(built.model.module.named_buffers(), fresh.named_buffers()):
        assert torch.equal(b, expected), name
