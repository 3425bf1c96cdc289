"""The aggregation maths, checked number by number (moved from the integration suite onto the
in-memory pair, tests/unit/pair.py): a coordinator with two workers, code none and one open round
(synchronous rounds), ends with the parameters of a plain single-process run of the same rounds:
the same initial model (seed), the same samples in each round (the sampler's plan over the
seeded epoch permutations, which the ledger's `applied` records confirm), the job's own optimizer
stepping on each round's mean gradient.

A test of accuracy would pass with a gradient off by a constant factor, a sample dropped or
counted twice, or a round applied with the wrong model version; this one does not. The workers
are real worker sessions computing with the job engine; their results cross the wire encoded.
"""

from __future__ import annotations

import numpy as np
import torch

from idlegrad.common.builtin_jobs import digits
from idlegrad.common.job import build, gather
from idlegrad.common.permutation import part_indices
from idlegrad.coordinator import checkpoint, ledger
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.server import CoordinatorConfig

from .pair import Pair

SEED = 7  # not the default: the seed must reach the model and every worker's sample order
PARTITIONS = 2
BATCH = 64  # digits' default is 32: half the rounds, the same maths


def planned_rounds(train_size: int, epochs: int) -> list[list[tuple[int, int, int]]]:
    sampler = Sampler(train_size, epochs)
    rounds = []
    while (parts := sampler.next_round(BATCH, PARTITIONS)) is not None:
        rounds.append(parts)
    return rounds


def reference_parameters(rounds) -> torch.Tensor:
    """One process, no workers, no aggregator: each round's samples in one batch, the job's
    optimizer stepping on its mean gradient."""
    job = digits(batch_size=BATCH)
    built = build(job, seed=SEED)
    model = built.model.module
    optimizer = job.build_optimizer(model.parameters())
    n = len(built.train)
    for parts in rounds:
        indices = np.concatenate([part_indices(SEED, n, *part) for part in parts])
        optimizer.zero_grad()
        job.loss(model, gather(built.train, indices)).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def test_synchronous_rounds_equal_a_single_process_run(tmp_path):
    ckpt, ledger_path = tmp_path / "ckpt", tmp_path / "ledger.jsonl"
    pair = Pair(CoordinatorConfig(
        job="digits", job_args={"batch_size": BATCH}, seed=SEED, epochs=1, redundancy="none",
        open_rounds=1, partitions=PARTITIONS, speculate=False, checkpoint_dir=str(ckpt),
        min_workers=2, ledger_path=str(ledger_path), heartbeat_s=0.5, eval_every=3600))
    workers = [pair.worker("w1"), pair.worker("w2")]
    pair.run()
    pair.close()
    assert pair.coordinator.stop_reason == "epochs"
    assert all(w.left is not None and not w.left.refused for w in workers)

    applied = [r for r in ledger.read(str(ledger_path)) if r["event"] == "applied"]
    rounds = planned_rounds(len(pair.coordinator.training.built.train), epochs=1)
    assert [sorted(tuple(p) for p in r["parts"]) for r in applied] == [sorted(p) for p in rounds]
    assert [r["version"] for r in applied] == list(range(1, len(rounds) + 1))
    # both workers computed: results came from the wire, not from one process's memory
    acked_by = {r["worker"] for r in ledger.read(str(ledger_path)) if r["event"] == "ack"}
    assert acked_by == {"w1", "w2"}

    state = checkpoint.load(str(ckpt))
    assert state["version"] == len(rounds)
    expected = reference_parameters([r["parts"] for r in applied])
    difference = float((state["params"] - expected).abs().max())
    assert difference <= 1e-6, f"max |coordinator - reference| = {difference:.3g}"
