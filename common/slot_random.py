"""The randomness inside a slot, reproducible on every side that computes it.

A slot's gradient is computed by a worker and, to check it, again by the coordinator or a third
worker (coordinator/verify.py); replicated and coded slots that share a part compute that part
more than once. When the job draws randomness inside the computation (dropout, augmentation in
its data set's `__getitem__`, noise in its loss), every side must draw the same, or an honest
worker's gradient looks wrong. So:

- before each micro-batch, torch's generators are seeded from (run seed, model version, epoch,
  the micro-batch's first position in that epoch's order) only: fields every task already
  carries, the same for every slot and every side computing those samples at that version
  (`micro_batch_seed`). The CPU generator, and the CUDA generator of the device computing, are
  seeded inside `torch.random.fork_rng`, so the states outside are left as they were
  (`seeded`). Python's `random` and numpy's global generator are not seeded: a job must not
  use them inside a slot.
- a draw depends on the shape it is drawn for, so a job that draws randomness is computed in
  fixed micro-batches on every side: cut at multiples of `Job.random_block` positions of the
  epoch's order (`micro_batch_end`), instead of the sizes a worker picks from its speed. A job
  that draws none keeps the free sizes. Whether it draws is found when the job is built
  (`draws_randomness`), the same on every side, and is part of its fingerprint.

A CUDA worker and a CPU coordinator still draw different masks (the two generators are
different algorithms): the same seed makes the same draws on one kind of device only.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .permutation import EpochOrder

# modules that draw from torch's generator in train mode (with a probability above zero)
_DROPOUT_MODULES: tuple[type, ...] = (nn.modules.dropout._DropoutNd, nn.RReLU)


def run_seed(order: EpochOrder) -> int:
    """The run's seed: the one the epoch order is made from (a seed, or a ShardOrder's)."""
    return int(order) if isinstance(order, int) else int(order.seed)


def micro_batch_seed(order: EpochOrder, version: int, epoch: int, position: int) -> int:
    """The seed of the micro-batch starting at `position` of `epoch`'s order, computed at
    `version`: a hash, so that neighbouring micro-batches get unrelated streams."""
    key = f"idlegrad-slot-random:{run_seed(order)}:{version}:{epoch}:{position}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def micro_batch_end(position: int, end: int, wanted: int, block: Optional[int]) -> int:
    """Where the micro-batch starting at `position` ends (before `end`): after `wanted`
    samples, or, for a job that draws randomness (`block`), at the next multiple of `block`.

    No micro-batch holds a single sample unless the whole part does: a model in training mode
    may refuse one (BatchNorm: "expected more than 1 value per channel"), and a worker's
    speed-sized micro-batch may come down to 1 on a busy machine. So a micro-batch takes at
    least two samples, and one that would leave a single sample behind takes it too."""
    if block is None:
        cut = position + max(2, wanted)
    else:
        cut = (position // block + 1) * block
        if cut - position == 1:  # a part starting just before a block's end
            cut += block
    return end if end - cut <= 1 else cut


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | str) -> Iterator[None]:
    """torch's CPU generator and `device`'s CUDA generator seeded with `seed` inside, and
    their states outside as they were."""
    device = torch.device(device)
    cuda = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def _generator_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def draws_randomness(module: nn.Module, probe: Optional[Callable[[], Any]] = None,
                     device: torch.device | str = "cpu") -> bool:
    """Whether computing the job draws from torch's generators: the model holds a dropout
    module (any of torch's, with p > 0, or RReLU), or `probe()` (one train-mode loss of the
    first training samples: the data set's `__getitem__` and the loss run in it) moves a
    generator. The probe runs without gradients, in forked generators, and leaves the
    module's mode and buffers as they were; a probe that fails tells nothing (False): the
    job's loss fails where it is first computed, and says so there."""
    for m in module.modules():
        if isinstance(m, nn.RReLU) or (isinstance(m, _DROPOUT_MODULES) and m.p > 0):
            return True
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            return True
    if probe is None:
        return False
    device = torch.device(device)
    was_training = module.training
    buffers = [b.detach().clone() for b in module.buffers()]
    try:
        with torch.no_grad(), seeded(0, device):
            before = _generator_states(device)
            module.train()
            probe()
            after = _generator_states(device)
        return any(not torch.equal(a, b) for a, b in zip(before, after))
    except Exception:
        return False
    finally:
        module.train(was_training)
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
