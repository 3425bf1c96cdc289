"""A built job and the computations both sides share: the flat model, data batches, evaluation,
and the gradient kernels that a worker runs for a slot and the coordinator runs to check one.

Also the public face of jobs: `Job` (common/job_definition.py) and the loading of job specs
(common/job_loading.py) are re-exported here, so that a job file imports
`idlegrad.common.job.Job`. The imports run one way: this module -> job_loading -> builtin_jobs
-> job_definition; nothing below imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from .blobs import dataset_fingerprint
from .errors import JobError
from .eval_sums import combine_sums
from .job_definition import MIXED_PRECISION, Job
from .job_loading import builtin_job_names, load_job, parse_job_args, resolve_factory
from .permutation import EpochOrder, ShardOrder, part_indices
from .slot_random import draws_randomness, micro_batch_end, micro_batch_seed, seeded

__all__ = [
    "BuiltJob", "EpochOrder", "FlatModel", "Job", "LocalChange", "LossTally",
    "accumulate_coded_gradient", "autocast_for", "batch_to", "build", "build_schedule",
    "builtin_job_names", "clip_", "coded_gradient", "combine_sums", "epoch_order", "eval_size",
    "evaluate", "evaluation_sums", "gather", "sums_evaluable",
    "load_job", "local_change", "make_optimizer", "model_bytes", "parse_job_args", "part_batch",
    "reference_gradient_norm", "resolve_factory", "shard_samples",
]


# a built job ------------------------------------------------------------------------------------


class FlatModel:
    """A model whose parameters and gradients are views into two flat vectors, and whose
    persistent buffers (BatchNorm's running statistics and counters, any registered buffer that
    is in its state dict) read and load as one float64 vector.

    Loading a model from the wire is then one copy into `params`, and a gradient is read straight
    from `grads`: no per-parameter packing on the hot path. Buffers are few and of mixed dtypes
    (float statistics, int64 counters): they stay where the module keeps them, and travel as
    float64, which holds every float dtype's values and integers up to 2**53 exactly.
    Non-persistent buffers are, by torch's convention, derived at build time (a causal mask):
    every side builds its own, and they never travel.
    """

    def __init__(self, module: nn.Module, device: torch.device | str = "cpu"):
        module = module.to(device)
        named = list(module.named_parameters())
        if not named:
            raise JobError("the model has no parameters")
        first_name, first = named[0]
        for name, p in named:
            if p.dtype != first.dtype:
                raise JobError(f"parameter {name!r} is {str(p.dtype).replace('torch.', '')}, "
                               f"while {first_name!r} is {str(first.dtype).replace('torch.', '')}: "
                               "all parameters must share one dtype (convert the model, e.g. "
                               "model.float(), and use the job's mixed_precision for bf16)")
        params = [p for _, p in named]
        self.module = module
        self.dtype = first.dtype
        self.numel = sum(p.numel() for p in params)
        self.params = torch.empty(self.numel, dtype=self.dtype, device=device)
        self.grads = torch.zeros(self.numel, dtype=self.dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.params[offset:offset + n].copy_(p.reshape(-1))
                p.data = self.params[offset:offset + n].view_as(p)
                p.grad = self.grads[offset:offset + n].view_as(p)
                offset += n
        self.buffers = persistent_buffers(module)
        self.buffer_numel = sum(b.numel() for _, b in self.buffers)
        # which values of the buffer vector are counters (integer or bool buffers): merged by
        # their maximum, not averaged (coordinator/model_state.py)
        self.counter_mask = torch.cat(
            [torch.full((b.numel(),), not b.is_floating_point()) for _, b in self.buffers]
        ) if self.buffers else torch.zeros(0, dtype=torch.bool)

    def buffers_flat(self) -> torch.Tensor:
        """The persistent buffers as one new float64 CPU vector (empty without buffers)."""
        if not self.buffers:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for _, b in self.buffers])

    def load_buffers(self, flat: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Copy in a buffer vector as `buffers_flat` makes it (whole or as consecutive chunks);
        counters are rounded to whole numbers."""
        if not isinstance(flat, torch.Tensor):
            flat = torch.cat(list(flat)) if len(flat) else torch.zeros(0, dtype=torch.float64)
        if flat.numel() != self.buffer_numel:
            raise ValueError(f"{flat.numel()} buffer values for a model of {self.buffer_numel}")
        offset = 0
        with torch.no_grad():
            for _, b in self.buffers:
                n = b.numel()
                values = flat[offset:offset + n].reshape(b.shape)
                if not b.is_floating_point():
                    values = values.round()
                b.copy_(values.to(b.device, b.dtype))
                offset += n

    def buffer_state(self) -> dict[str, torch.Tensor]:
        """The persistent buffers by name, in their own dtypes (for checkpoints)."""
        return {name: b.detach().to("cpu", copy=True) for name, b in self.buffers}

    def load_buffer_state(self, state: dict) -> list[str]:
        """Load buffers by name from `buffer_state`'s form; the names this model has and `state`
        lacks (or holds in another shape) are returned, and keep their values."""
        missing = []
        with torch.no_grad():
            for name, b in self.buffers:
                value = state.get(name)
                if not isinstance(value, torch.Tensor) or value.shape != b.shape:
                    missing.append(name)
                    continue
                b.copy_(value.to(b.device, b.dtype))
        return missing

    def buffer_layout(self) -> list[list]:
        return [[name, list(b.shape), str(b.dtype).replace("torch.", "")]
                for name, b in self.buffers]

    def load(self, flat: torch.Tensor | list[torch.Tensor]) -> None:
        """Copy in a flat parameter vector, whole or as consecutive chunks (received frames)."""
        with torch.no_grad():
            if isinstance(flat, torch.Tensor):
                self.params.copy_(flat, non_blocking=False)
                return
            offset = 0
            for chunk in flat:
                self.params[offset:offset + chunk.numel()].copy_(chunk)
                offset += chunk.numel()
            if offset != self.numel:
                raise ValueError(f"chunks of {offset} values for a model of {self.numel}")

    def use_grads(self, buffer: torch.Tensor) -> None:
        """Make `buffer` (flat, numel values) the gradient store: each parameter's .grad becomes
        a view of it. Lets a caller send one gradient while the next is computed into another."""
        if buffer.shape != (self.numel,) or buffer.dtype != self.dtype:
            raise ValueError("a gradient buffer must be flat, of the model's size and dtype")
        offset = 0
        for p in self.module.parameters():
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.grads = buffer

    def layout(self) -> list[list]:
        return [[name, list(p.shape), str(p.dtype).replace("torch.", "")]
                for name, p in self.module.named_parameters()]


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's buffers that are in its state dict, by name, shared ones once. JobError for
    a buffer no float64 can carry (a complex one)."""
    out = []
    for name, buffer in module.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf in owner._non_persistent_buffers_set:
            continue
        if buffer.is_complex():
            raise JobError(f"buffer {name!r} is {str(buffer.dtype).replace('torch.', '')}: "
                           "buffers must be real (float, integer or bool)")
        out.append((name, buffer))
    return out


def model_bytes(job: Job) -> Optional[int]:
    """Bytes of the parameters and buffers `job.build_model()` makes, found by building it on
    torch's meta device, where tensors have shapes and no storage: a model too large for this
    machine is measured without being allocated. None when the model cannot be built there (it
    loads weights from a file, say)."""
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            module = job.build_model()
    except Exception:
        return None
    if not isinstance(module, nn.Module):
        return None
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class BuiltJob:
    job: Job
    model: FlatModel
    train: Dataset
    test: Dataset
    fingerprint: str
    # what the fingerprint is a hash of: name, parameter and buffer layouts, data set sizes and
    # manifests; peers compare them to say what differs (job_differences)
    identity: dict = field(default_factory=dict)
    # samples per micro-batch, on every side, of a job that draws randomness (cut at multiples
    # of it in the epoch's order: common/slot_random.py); None: micro-batches of any size
    random_block: Optional[int] = None


def build(job: Job, device: torch.device | str = "cpu", seed: int = 0,
          need_test: bool = True, store: Optional[Any] = None) -> BuiltJob:
    """Build model and data sets, check they are usable, and compute the job's fingerprint.
    `store`: where a job that declares its data by manifest (`job.data`) finds its blobs."""
    if job.data is not None and store is None:
        raise JobError(f"job {job.name!r} declares its data by manifest {str(job.data)[:12]}: "
                       "it needs the packed data (the coordinator's --data DIR)")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = job.build_model()
        datasets = job.build_datasets() if job.data is None else job.build_datasets(store)
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"job {job.name!r} failed to build: {type(exc).__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        raise JobError(f"job {job.name!r}: build_model returned {type(module).__name__}, not nn.Module")
    if not (isinstance(datasets, (tuple, list)) and len(datasets) == 2):
        raise JobError(f"job {job.name!r}: build_datasets must return (train, test)")
    train, test = datasets
    for label, ds in (("train", train), ("test", test)):
        if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
            raise JobError(f"job {job.name!r}: the {label} data set must be map-style (len and [i])")
    if len(train) == 0:
        raise JobError(f"job {job.name!r}: the training set is empty")
    _check_recipe(job)
    model = FlatModel(module, device)
    identity = {"name": job.name, "params": model.layout(), "train": len(train), "test": len(test)}
    if model.buffers:  # only then, so that a model without buffers keeps its fingerprint
        identity["buffers"] = model.buffer_layout()
    random_block = job.random_block if _draws_randomness(job, model, train) else None
    if random_block is not None:  # only then: a job drawing none keeps its fingerprint
        identity["random_block"] = random_block
    # Content-addressed data (a ShardedDataset) names its bytes: both sides must hold the same
    # manifest. Only then is the key added, so a job without one keeps its fingerprint.
    data = {label: dataset_fingerprint(ds) for label, ds in (("train", train), ("test", test))}
    if any(data.values()):
        identity["data"] = data
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return BuiltJob(job, model, train, test, digest, identity, random_block)


def _draws_randomness(job: Job, model: FlatModel, train: Dataset) -> bool:
    """The job's word, else slot_random's finding: the probe reads the first training samples
    of an in-memory data set only (content-addressed data may not be fetched yet on a worker;
    every side skips it alike)."""
    if job.draws_randomness is not None:
        return bool(job.draws_randomness)
    device = model.params.device
    probe = None
    if dataset_fingerprint(train) is None:
        def probe():
            batch = gather(train, list(range(min(2, len(train)))), job.collate)
            job.loss(model.module, batch_to(batch, device))
    return draws_randomness(model.module, probe, device)


def job_differences(here: dict, there: dict, here_is: str = "here",
                    there_is: str = "there", most: int = 3) -> list[str]:
    """What differs between two jobs' identities (BuiltJob.identity), one phrase each, at
    most `most` per kind; a peer's identity is untrusted, so only its expected keys are read."""
    out: list[str] = []

    def pair(a, b) -> str:
        return f"{a} {here_is}, {b} {there_is}"

    def layout(entry) -> str:  # [shape, dtype], or None where the tensor is missing
        return "none" if entry is None else f"{entry[0]} {entry[1]}"

    if here.get("name") != there.get("name"):
        out.append(f"job name {pair(repr(here.get('name')), repr(there.get('name')))}")
    for key, kind in (("params", "parameter"), ("buffers", "buffer")):
        ours = {e[0]: e[1:] for e in here.get(key) or []}
        theirs = {e[0]: e[1:] for e in there.get(key) or []}
        found = []
        for name in [*ours, *(n for n in theirs if n not in ours)]:
            a, b = ours.get(name), theirs.get(name)
            if a == b:
                continue
            found.append(f"{kind} {name}: {pair(layout(a), layout(b))}")
        if not found and list(ours) != list(theirs):
            found.append(f"{kind} order differs")
        out.extend(found[:most])
        if len(found) > most:
            more = len(found) - most
            out.append(f"and {more} more {kind}{'s' if more > 1 else ''}")
    for key, label in (("train", "training set"), ("test", "test set")):
        if here.get(key) != there.get(key):
            out.append(f"{label}: {pair(f'{here.get(key)} samples', f'{there.get(key)} samples')}")
    if here.get("random_block") != there.get("random_block"):
        a, b = (f"micro-batches of {v} (randomness)" if v else "free micro-batches"
                for v in (here.get("random_block"), there.get("random_block")))
        out.append(pair(a, b))
    ours, theirs = here.get("data") or {}, there.get("data") or {}
    for key in ("train", "test"):
        a, b = ours.get(key), theirs.get(key)
        if a != b:
            a, b = (str(v)[:12] if v else "none" for v in (a, b))
            out.append(f"{key} data manifest {pair(a, b)}")
    return out


def _check_recipe(job: Job) -> None:
    """JobError for recipe fields that cannot work, at build rather than at the first step."""
    if job.lr_lambda is not None and job.build_scheduler is not None:
        raise JobError(f"job {job.name!r}: give lr_lambda or build_scheduler, not both")
    for label in ("lr_lambda", "build_scheduler", "collate"):
        value = getattr(job, label)
        if value is not None and not callable(value):
            raise JobError(f"job {job.name!r}: {label} must be callable")
    if job.clip_norm is not None and not (isinstance(job.clip_norm, (int, float))
                                          and job.clip_norm > 0 and math.isfinite(job.clip_norm)):
        raise JobError(f"job {job.name!r}: clip_norm must be a positive number, got "
                       f"{job.clip_norm!r}")
    if not (isinstance(job.random_block, int) and job.random_block >= 1):
        raise JobError(f"job {job.name!r}: random_block must be a whole number >= 1, got "
                       f"{job.random_block!r}")
    if job.mixed_precision is not None and job.mixed_precision not in MIXED_PRECISION:
        raise JobError(f"job {job.name!r}: mixed_precision {job.mixed_precision!r} unknown: use "
                       f"{', '.join(MIXED_PRECISION)} or None")


def make_optimizer(job: Job, module: nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer over `module`: given (name, parameter) pairs when `build_optimizer`'s
    argument is named `named_parameters`, else the parameters (the original signature)."""
    try:
        wants_names = "named_parameters" in inspect.signature(job.build_optimizer).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        wants_names = False
    if wants_names:
        return job.build_optimizer(named_parameters=list(module.named_parameters()))
    return job.build_optimizer(module.parameters())


def build_schedule(job: Job, optimizer: torch.optim.Optimizer) -> Optional[Any]:
    """The job's learning-rate scheduler over `optimizer` (stepped once per applied step), or
    None. Built before a checkpoint's optimizer state is loaded: a scheduler's construction sets
    the groups' learning rates, which the checkpoint then restores."""
    if job.lr_lambda is not None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, job.lr_lambda)
    if job.build_scheduler is None:
        return None
    schedule = job.build_scheduler(optimizer)
    if not all(callable(getattr(schedule, m, None)) for m in ("step", "state_dict",
                                                              "load_state_dict")):
        raise JobError(f"job {job.name!r}: build_scheduler returned {type(schedule).__name__}, "
                       "not a torch LR scheduler (step, state_dict, load_state_dict)")
    return schedule


def clip_(grads: torch.Tensor, max_norm: Optional[float], norm: Optional[float] = None) -> bool:
    """Scale the flat gradient `grads` down to L2 norm `max_norm` when it is longer (`norm`: its
    norm when known). Whether it was clipped."""
    if max_norm is None:
        return False
    if norm is None:
        norm = float(torch.linalg.vector_norm(grads, dtype=torch.float64))
    if not norm > max_norm:
        return False
    grads.mul_(max_norm / norm)
    return True


def autocast_for(job: Job, device: torch.device | str) -> contextlib.AbstractContextManager:
    """bfloat16 autocast where the job asks for it and `device` is CUDA; elsewhere nothing, so
    that CPU workers and the coordinator compute exactly as without it."""
    device = torch.device(device)
    if job.mixed_precision == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gather(dataset: Dataset, indices, collate: Optional[Callable[[list], Any]] = None) -> Any:
    """The batch of `dataset` at `indices`: `collate` of the samples, or as torch's default
    collate would make it."""
    if collate is not None:
        return collate([dataset[int(i)] for i in indices])
    if isinstance(dataset, TensorDataset):
        idx = torch.tensor(indices, dtype=torch.long)  # a copy: the permutation is read-only
        return [t[idx] for t in dataset.tensors]
    return default_collate([dataset[int(i)] for i in indices])


def shard_samples(dataset: Dataset) -> Optional[tuple[int, ...]]:
    """Samples per shard of a sharded data set (a ShardedDataset's manifest), in the order it
    numbers them; None for a data set that is not sharded."""
    if dataset_fingerprint(dataset) is None:
        return None
    sizes = getattr(dataset, "shard_sizes", None)
    if sizes is not None:  # a ShardedDataset, maybe a view of part of its pack
        return tuple(int(n) for n in sizes())
    manifest = getattr(dataset, "manifest", None)
    return None if manifest is None else tuple(int(shard.samples) for shard in manifest.shards)


def epoch_order(dataset: Dataset, seed: int, window: int) -> EpochOrder:
    """The order both sides read `dataset` in: shard-aware with a window of `window` shards
    when it is sharded and `window` > 0, else the full shuffle of `seed` (today's order)."""
    sizes = shard_samples(dataset) if window > 0 else None
    if not sizes:
        return seed
    return ShardOrder(seed, sizes, window)


def part_batch(dataset: Dataset, order: EpochOrder, epoch: int, offset: int, count: int,
               collate: Optional[Callable[[list], Any]] = None) -> Any:
    """`order`: a seed (the full shuffle) or a ShardOrder (`epoch_order`)."""
    return gather(dataset, part_indices(order, len(dataset), epoch, offset, count), collate)


def batch_to(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: batch_to(v, device) for k, v in batch.items()}
    return batch


EVAL_CHUNK = 256  # test samples per forward when evaluating


@torch.no_grad()
def evaluate(job: Job, module: nn.Module, test: Dataset, chunk: int = EVAL_CHUNK
             ) -> dict[str, float]:
    """The job's own evaluation, or its `evaluate_sums` (the default: mean test loss plus
    accuracy for class logits) over its evaluated test samples, combined."""
    was_training = module.training
    module.eval()
    try:
        if job.evaluate is not None:
            return {str(k): float(v) for k, v in job.evaluate(module, test).items()}
        return combine_sums([evaluation_sums(job, module, test, 0, eval_size(job, test), chunk)])
    finally:
        module.train(was_training)


def eval_size(job: Job, test: Dataset) -> int:
    """How many test samples (the first ones) an evaluation covers."""
    n = len(test)
    return n if job.eval_samples is None else max(0, min(n, int(job.eval_samples)))


def sums_evaluable(job: Job) -> bool:
    """Whether the job's evaluation is a sum over test samples (so ranges of the test set can
    be evaluated apart, on workers): `evaluate_sums`, or the default with no `evaluate`."""
    return job.evaluate_sums is not None or job.evaluate is None


@torch.no_grad()
def evaluation_sums(job: Job, module: nn.Module, test: Dataset, start: int, count: int,
                    chunk: int | Callable[[], int] = EVAL_CHUNK,
                    between: Optional[Callable[[], None]] = None,
                    observe: Optional[Callable[[int], None]] = None
                    ) -> dict[str, tuple[float, float]]:
    """`{metric: (sum, count)}` over test samples [start, start + count), in eval mode, in
    chunks (`chunk`: a size, or a callable the worker's engine sizes from its speed; `between`
    and `observe` as for the gradient kernels). Sums of a range's pieces add up to the range's."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    totals: dict[str, list[float]] = {}
    try:
        done = 0
        while done < count:
            if between is not None:
                between()
            size = chunk() if callable(chunk) else chunk
            idx = list(range(start + done, start + min(count, done + max(1, size))))
            batch = batch_to(gather(test, idx, job.collate), device)
            sums = (job.evaluate_sums(module, batch) if job.evaluate_sums is not None
                    else classification_sums(job, module, batch))
            for name, (total, counted) in sums.items():
                entry = totals.setdefault(str(name), [0.0, 0.0, 0])
                entry[0] += float(total)
                entry[1] += float(counted)
                entry[2] += 1
            done += len(idx)
            if observe is not None:
                observe(len(idx))
        chunks = max((e[2] for e in totals.values()), default=0)
        # a metric some chunk did not report (accuracy of a batch that is not class logits)
        # would be a mean over part of the range: dropped
        return {name: (e[0], e[1]) for name, e in totals.items() if e[2] == chunks}
    finally:
        module.train(was_training)


def classification_sums(job: Job, module: nn.Module, batch: Any
                        ) -> dict[str, tuple[float, float]]:
    """The default evaluation of a batch: the summed loss and, when the model returns class
    logits for integer labels, the correct count."""
    n = _batch_len(batch)
    sums = {"loss": (float(job.loss(module, batch)) * n, float(n))}
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        x, y = batch
        if isinstance(y, torch.Tensor) and not y.is_floating_point() and y.dim() == 1:
            out = module(x)
            if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == y.shape[0]:
                sums["accuracy"] = (float((out.argmax(dim=1) == y).sum()), float(n))
    return sums


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    raise JobError("cannot tell the size of a test batch: give the job an evaluate_sums")


def reference_gradient_norm(job: Job, model: FlatModel, train: Dataset, seed: EpochOrder,
                            count: int = 32) -> float:
    """The norm of the summed per-sample gradient of the first `count` samples of epoch 0, divided
    by `count`: what an honest slot's gradient looks like, per sample, at `model`'s parameters.

    `model`'s gradients are overwritten: pass a scratch copy.
    """
    count = max(1, min(count, len(train)))
    model.grads.zero_()
    model.module.train()
    with seeded(micro_batch_seed(seed, 0, 0, 0), model.params.device):  # leaves torch's RNG be
        loss = job.loss(model.module, part_batch(train, seed, 0, 0, count, job.collate))
        (loss * count).backward()
    norm = float(torch.linalg.vector_norm(model.grads, dtype=torch.float64))
    model.grads.zero_()
    return norm / count


SUMMED_LOSS_RATIO = 1.5  # a mean over a batch and its half: about 1; a sum: about 2


def summed_loss_warning(job: Job, module: nn.Module, train: Dataset, order: EpochOrder
                        ) -> Optional[str]:
    """One line when the job's loss looks like a sum over the batch rather than the mean that
    idlegrad expects (gradients are scaled as means, and `loss<=` targets read means): the loss
    of the first batch against the loss of its first half. None when it looks like a mean, or
    when the check cannot tell (a tiny batch, a loss near zero or not finite, a loss that fails:
    its failure is reported where the loss is first computed)."""
    count = min(job.batch_size, len(train))
    if count < 4:
        return None
    was_training = module.training
    module.eval()  # no dropout draws, no BatchNorm statistics updated
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            whole, half = (float(job.loss(module, part_batch(train, order, 0, 0, n, job.collate)))
                           for n in (count, count // 2))
    except Exception:
        return None
    finally:
        module.train(was_training)
    if not (math.isfinite(whole) and math.isfinite(half)) or abs(half) < 1e-8:
        return None
    ratio = whole / half
    if ratio < SUMMED_LOSS_RATIO:
        return None
    return (f"job {job.name!r}: its loss looks like a sum over the batch, not the mean idlegrad "
            f"expects: {whole:.4g} on the first {count} training samples, {half:.4g} on "
            f"{count // 2} ({ratio:.2f} times); its gradients and loss<= targets then scale with "
            "the batch (divide the loss by the batch's size, e.g. reduction='mean')")


@dataclass
class LossTally:
    loss_sum: float  # the per-sample losses of every part, summed (zero-coefficient parts too)
    samples: int


def accumulate_coded_gradient(job: Job, model: FlatModel, train: Dataset, seed: EpochOrder,
                              parts: Sequence[Sequence[int]], coefficients: Sequence[float],
                              micro_batch: Callable[[], int] = lambda: 256,
                              device: torch.device | str | None = None,
                              between: Optional[Callable[[], None]] = None,
                              observe: Optional[Callable[[int], None]] = None,
                              version: int = 0, block: Optional[int] = None) -> LossTally:
    """Add sum_j coefficients[j] * (summed per-sample gradient of parts[j]) at `model`'s
    parameters to `model.grads`, each part = (epoch, offset, count) into the order `seed` names
    (a seed, or a ShardOrder: `epoch_order`): a slot's coded gradient. The
    one implementation that a worker runs for a slot (worker/engine.py) and the coordinator runs
    to check one, so that an honest worker and the coordinator compute alike, bit for bit when
    their micro-batches are the same.

    The caller loads the parameters and zeroes the gradients. Each part is cut into micro-batches
    of `micro_batch()` samples (the worker sizes them from its speed); `between()` runs before each
    part and each micro-batch (the worker's cancel and pause checks: it may raise), and
    `observe(samples)` after each micro-batch. Batches go to `device`, by default the model's.

    Each micro-batch runs with torch's generators seeded from (`seed`, `version`, epoch, its
    first position), and `block` (the BuiltJob's `random_block`) fixes the micro-batches of a
    job that draws randomness, so that every side draws alike (common/slot_random.py).
    """
    device = torch.device(device) if device is not None else model.params.device
    autocast = autocast_for(job, device)
    model.module.train()
    n = len(train)
    loss_sum, samples = 0.0, 0
    for (epoch, offset, count), coefficient in zip(parts, coefficients):
        # Between parts too: a part may be empty, and the worker's owner and the coordinator must
        # not wait for a micro-batch that never comes.
        if between is not None:
            between()
        indices = part_indices(seed, n, epoch, offset, count)
        position = 0
        while position < count:
            if between is not None:
                between()
            end = micro_batch_end(offset + position, offset + count, micro_batch(), block) - offset
            chunk = indices[position:end]
            with seeded(micro_batch_seed(seed, version, epoch, offset + position), device):
                with autocast:
                    batch = batch_to(gather(train, chunk, job.collate), device)
                    loss = job.loss(model.module, batch)
                if coefficient != 0.0:
                    # loss is a batch mean; the slot wants the coded *sum* of per-sample gradients
                    (loss * (len(chunk) * coefficient)).backward()
            loss_sum += float(loss.detach()) * len(chunk)
            samples += len(chunk)
            position += len(chunk)
            if observe is not None:
                observe(len(chunk))
    return LossTally(loss_sum, samples)


def coded_gradient(job: Job, model: FlatModel, params: torch.Tensor, train: Dataset,
                   seed: EpochOrder,
                   parts: Sequence[Sequence[int]], coefficients: Sequence[float],
                   micro_batch: int = 256, version: int = 0,
                   block: Optional[int] = None) -> torch.Tensor:
    """A slot's coded gradient at `params`, computed on the coordinator to check a worker's (its
    third opinion): the worker's kernel, in micro-batches of `micro_batch` samples (of `block`
    for a job that draws randomness), at model version `version` (its randomness is keyed by it).

    `model` is a scratch copy: its parameters and gradients are overwritten.
    """
    model.load(params)
    model.grads.zero_()
    accumulate_coded_gradient(job, model, train, seed, parts, coefficients,
                              micro_batch=lambda: micro_batch, version=version, block=block)
    return model.grads.detach().clone()


@dataclass
class LocalChange:
    change: torch.Tensor  # coefficient * samples * (start - end), on the model's device
    loss_sum: float  # the inner steps' per-sample losses, summed
    samples: int


def local_change(job: Job, model: FlatModel, initial: torch.Tensor, train: Dataset,
                 seed: EpochOrder,
                 part, coefficient: float, steps: int, device: torch.device | str = "cpu",
                 micro_batch: Callable[[], int] = lambda: 256,
                 between: Optional[Callable[[], None]] = None,
                 observe: Optional[Callable[[int], None]] = None,
                 version: int = 0, block: Optional[int] = None) -> LocalChange:
    """A local slot's result: `steps` inner steps of the job's optimizer, built afresh, over the
    samples of `part` = (epoch, offset, count), from `initial`; what a worker returns for the slot
    (worker/engine.py) and what the coordinator computes to settle a disputed one. One
    implementation for both sides, so that an honest worker and the coordinator agree.

    Each step is cut into micro-batches of `micro_batch()` samples (the worker sizes them from its
    speed); `between()` runs before each (the worker's cancel and pause checks: it may raise), and
    `observe(samples)` after each. `model` is overwritten: it ends at the last step. `version`
    and `block` as for `accumulate_coded_gradient`: every side draws the same randomness.
    """
    device = torch.device(device)
    model.load(initial)
    model.module.train()
    optimizer = make_optimizer(job, model.module)
    autocast = autocast_for(job, device)
    epoch, offset, count = part
    indices = part_indices(seed, len(train), epoch, offset, count)
    steps = max(1, min(steps, count)) if count else 0
    loss_sum, samples = 0.0, 0
    for step in range(steps):
        lo, hi = count * step // steps, count * (step + 1) // steps
        model.grads.zero_()
        position = lo
        while position < hi:
            if between is not None:
                between()
            end = micro_batch_end(offset + position, offset + hi, micro_batch(), block) - offset
            chunk = indices[position:end]
            with seeded(micro_batch_seed(seed, version, epoch, offset + position), device):
                batch = batch_to(gather(train, chunk, job.collate), device)
                with autocast:
                    loss = job.loss(model.module, batch)
                (loss * (len(chunk) / (hi - lo))).backward()  # the step's mean loss
            loss_sum += float(loss.detach()) * len(chunk)
            samples += len(chunk)
            position += len(chunk)
            if observe is not None:
                observe(len(chunk))
        clip_(model.grads, job.clip_norm)
        optimizer.step()
    change = initial.to(model.params.device, copy=True).sub_(model.params)
    change.mul_(coefficient * samples)
    return LocalChange(change, loss_sum, samples)
