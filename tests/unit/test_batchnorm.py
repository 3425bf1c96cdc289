"""Model state beyond parameters (moved from the integration suite onto the in-memory pair,
tests/unit/pair.py): a BatchNorm MLP trained by a coordinator and four workers evaluates, from
idlegrad's own checkpoint in eval mode, as well as the same model trained in one process on the
same samples in the same order. The buffers cross the wire both ways, encoded."""

from __future__ import annotations

from idlegrad.common.builtin_jobs import digits
from idlegrad.common.job import build, evaluate, make_optimizer, part_batch
from idlegrad.coordinator import checkpoint
from idlegrad.coordinator.server import CoordinatorConfig

from .pair import Pair

EPOCHS = 2
WORKERS = 4


def trained_in_one_process(seed: int, samples: int) -> float:
    """Eval-mode accuracy of the job trained by a plain loop over the coordinator's sample order
    (common/permutation.py), one step per batch, for `samples` samples."""
    job = digits(norm="batch")
    built = build(job, seed=seed)  # the coordinator's initial model: the same seed
    optimizer = make_optimizer(job, built.model.module)
    done, epoch = 0, 0
    while done < samples:
        for offset in range(0, len(built.train), job.batch_size):
            count = min(job.batch_size, len(built.train) - offset, samples - done)
            if count <= 0:
                break
            built.model.grads.zero_()
            job.loss(built.model.module, part_batch(built.train, seed, epoch, offset, count)
                     ).backward()
            optimizer.step()
            done += count
        epoch += 1
    return evaluate(job, built.model.module, built.test)["accuracy"]


def test_batchnorm_model_trained_by_four_workers_matches_one_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    pair = Pair(CoordinatorConfig(job="digits", job_args={"norm": "batch"}, epochs=EPOCHS,
                                  open_rounds=1, partitions=WORKERS, checkpoint_dir=str(ckpt),
                                  heartbeat_s=0.5, eval_every=3600))
    workers = [pair.worker(f"w{i}") for i in range(WORKERS)]
    pair.run()
    pair.close()
    assert all(w.left is not None and not w.left.refused and w.computed for w in workers)
    assert pair.final()["reason"] == "epochs"

    state = checkpoint.load(str(ckpt))
    job = digits(norm="batch")
    built = build(job)
    built.model.load(state["params"])
    built.model.load_buffer_state(state["buffers"])
    accuracy = evaluate(job, built.model.module, built.test)["accuracy"]
    reference = trained_in_one_process(0, int(state["samples"]))
    assert state["samples"] == EPOCHS * len(built.train)
    assert abs(accuracy - reference) <= 0.01, (accuracy, reference)
    assert accuracy > 0.9
    # Every round's four slots each ran one forward pass (a part of 8 samples, one micro-batch)
    # from the round's counter: the merged counter advanced once a step, as DDP's would
    assert int(state["buffers"]["1.num_batches_tracked"]) == state["version"] > 0
