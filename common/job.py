"""Jobs: what to train, defined locally on every machine and named on the wire, never sent.

A job spec is a built-in name (`digits`, `synthetic`), `package.module:attr`, or
`path/to/file.py:attr`; `attr` is a callable returning a `Job`. Keyword arguments from the command
line (`--job-arg key=value`) are passed to that callable, and travel to workers in WELCOME so that
both sides build the same job.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from .errors import JobError, ProtocolError
from .permutation import part_indices
from .protocol import check_job_args


@dataclass(frozen=True)
class Job:
    """What to train. `loss` returns the *mean* loss of the batch it is given (torch's default)."""

    name: str
    build_model: Callable[[], nn.Module]
    build_datasets: Callable[[], tuple[Dataset, Dataset]]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    build_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batch_size: int
    evaluate: Optional[Callable[[nn.Module, Dataset], dict[str, float]]] = None


# loading ------------------------------------------------------------------------------------------


def _builtin_jobs() -> dict[str, Callable[..., Job]]:
    from . import builtin_jobs

    return builtin_jobs.BUILTIN


def builtin_job_names() -> list[str]:
    return sorted(_builtin_jobs())


def resolve_factory(spec: str) -> Callable[..., Job]:
    """The callable a spec names. Raises JobError with one clear line."""
    builtin = _builtin_jobs()
    if spec in builtin:
        return builtin[spec]
    if ":" not in spec:
        raise JobError(f"unknown job {spec!r}: use a built-in ({', '.join(sorted(builtin))}), "
                       "module:attr or path/to/file.py:attr")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise JobError(f"job spec {spec!r} must look like module:attr or path/to/file.py:attr")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_file(where)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise JobError(f"cannot import job module {where!r}: {exc}") from None
        except Exception as exc:
            raise JobError(f"job module {where!r} failed to import: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise JobError(f"{where!r} has no attribute {attr!r}")
    if not callable(factory):
        raise JobError(f"{spec!r} is not callable; it must be a function returning a Job")
    return factory


def _import_file(path: str):
    if not os.path.isfile(path):
        raise JobError(f"job file {path!r} does not exist")
    name = "idlegrad_job_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise JobError(f"cannot load job file {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise JobError(f"job file {path!r} failed to import: {type(exc).__name__}: {exc}") from None
    return module


def load_job(spec: str, args: Optional[dict[str, Any]] = None) -> Job:
    factory = resolve_factory(spec)
    try:
        inspect.signature(factory).bind(**(args or {}))
    except TypeError as exc:
        raise JobError(f"job {spec!r} does not take these arguments {sorted(args or {})}: {exc}") from None
    except ValueError:
        pass  # no signature to check (a builtin): the call itself will tell
    try:
        job = factory(**(args or {}))
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"job {spec!r} failed to build: {type(exc).__name__}: {exc}") from None
    if not isinstance(job, Job):
        raise JobError(f"job {spec!r} returned {type(job).__name__}, not idlegrad.common.job.Job")
    if not isinstance(job.batch_size, int) or job.batch_size <= 0:
        raise JobError(f"job {job.name!r}: batch_size must be a positive int")
    return job


def parse_job_args(items: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings -> kwargs; values become int, float or bool where they read as one.

    They travel to workers in a welcome, whose bounds they are held to here: a coordinator
    started with arguments no worker would take says so at once."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise JobError(f"job argument {item!r} must look like name=value")
        out[key] = _parse_scalar(text)
    try:
        check_job_args(out, "--job-arg")
    except ProtocolError as exc:
        raise JobError(exc.detail) from None
    return out


def _parse_scalar(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if kind is float and not math.isfinite(value):
            break
        return value
    return text


# a built job ------------------------------------------------------------------------------------


class FlatModel:
    """A model whose parameters and gradients are views into two flat vectors.

    Loading a model from the wire is then one copy into `params`, and a gradient is read straight
    from `grads`: no per-parameter packing on the hot path.
    """

    def __init__(self, module: nn.Module, device: torch.device | str = "cpu"):
        module = module.to(device)
        params = list(module.parameters())
        if not params:
            raise JobError("the model has no parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise JobError(f"all parameters must share one dtype, found {sorted(map(str, dtypes))}")
        self.module = module
        self.dtype = params[0].dtype
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


def build(job: Job, device: torch.device | str = "cpu", seed: int = 0,
          need_test: bool = True) -> BuiltJob:
    """Build model and data sets, check they are usable, and compute the job's fingerprint."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = job.build_model()
        datasets = job.build_datasets()
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
    model = FlatModel(module, device)
    identity = {"name": job.name, "params": model.layout(), "train": len(train), "test": len(test)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return BuiltJob(job, model, train, test, digest)


def gather(dataset: Dataset, indices) -> Any:
    """The batch of `dataset` at `indices`, as torch's default collate would make it."""
    if isinstance(dataset, TensorDataset):
        idx = torch.tensor(indices, dtype=torch.long)  # a copy: the permutation is read-only
        return [t[idx] for t in dataset.tensors]
    return default_collate([dataset[int(i)] for i in indices])


def part_batch(dataset: Dataset, seed: int, epoch: int, offset: int, count: int) -> Any:
    return gather(dataset, part_indices(seed, len(dataset), epoch, offset, count))


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


@torch.no_grad()
def evaluate(job: Job, module: nn.Module, test: Dataset, chunk: int = 1024) -> dict[str, float]:
    """The job's own evaluation, or mean test loss plus accuracy for class logits."""
    was_training = module.training
    module.eval()
    try:
        if job.evaluate is not None:
            return {str(k): float(v) for k, v in job.evaluate(module, test).items()}
        return _default_evaluate(job, module, test, chunk)
    finally:
        module.train(was_training)


def _default_evaluate(job: Job, module: nn.Module, test: Dataset, chunk: int) -> dict[str, float]:
    n = len(test)
    if n == 0:
        return {}
    device = next(module.parameters()).device
    loss_sum, correct, counted = 0.0, 0, 0
    classify = True
    for start in range(0, n, chunk):
        idx = range(start, min(n, start + chunk))
        batch = batch_to(gather(test, list(idx)), device)
        loss_sum += float(job.loss(module, batch)) * len(idx)
        if classify and isinstance(batch, (list, tuple)) and len(batch) == 2:
            x, y = batch
            if isinstance(y, torch.Tensor) and not y.is_floating_point() and y.dim() == 1:
                out = module(x)
                if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == y.shape[0]:
                    correct += int((out.argmax(dim=1) == y).sum())
                    counted += len(idx)
                    continue
        classify = False
    metrics = {"loss": loss_sum / n}
    if classify and counted == n:
        metrics["accuracy"] = correct / n
    return metrics


def reference_gradient_norm(job: Job, model: FlatModel, train: Dataset, seed: int,
                            count: int = 32) -> float:
    """The norm of the summed per-sample gradient of the first `count` samples of epoch 0, divided
    by `count`: what an honest slot's gradient looks like, per sample, at `model`'s parameters.

    `model`'s gradients are overwritten: pass a scratch copy.
    """
    count = max(1, min(count, len(train)))
    model.grads.zero_()
    model.module.train()
    loss = job.loss(model.module, part_batch(train, seed, 0, 0, count))
    (loss * count).backward()
    norm = float(torch.linalg.vector_norm(model.grads, dtype=torch.float64))
    model.grads.zero_()
    return norm / count


def coded_gradient(job: Job, model: FlatModel, params: torch.Tensor, train: Dataset, seed: int,
                   parts: list, coefficients: list, chunk: int = 256) -> torch.Tensor:
    """sum_j coefficients[j] * (summed per-sample gradient of parts[j]) at `params`: what a
    worker returns for a slot, computed here in one piece (the coordinator's third opinion).

    `model` is a scratch copy: its parameters and gradients are overwritten.
    """
    model.load(params)
    model.grads.zero_()
    model.module.train()
    n = len(train)
    for (epoch, offset, count), coefficient in zip(parts, coefficients):
        if coefficient == 0.0:
            continue
        indices = part_indices(seed, n, epoch, offset, count)
        for start in range(0, count, chunk):
            piece = indices[start:start + chunk]
            loss = job.loss(model.module, gather(train, piece))
            (loss * (len(piece) * coefficient)).backward()
    return model.grads.detach().clone()


@dataclass
class LocalChange:
    change: torch.Tensor  # coefficient * samples * (start - end), on the model's device
    loss_sum: float  # the inner steps' per-sample losses, summed
    samples: int


def local_change(job: Job, model: FlatModel, initial: torch.Tensor, train: Dataset, seed: int,
                 part, coefficient: float, steps: int, device: torch.device | str = "cpu",
                 micro_batch: Callable[[], int] = lambda: 256,
                 between: Optional[Callable[[], None]] = None,
                 observe: Optional[Callable[[int, float], None]] = None) -> LocalChange:
    """A local slot's result: `steps` inner steps of the job's optimizer, built afresh, over the
    samples of `part` = (epoch, offset, count), from `initial`; what a worker returns for the slot
    (worker/engine.py) and what the coordinator computes to settle a disputed one. One
    implementation for both sides, so that an honest worker and the coordinator agree.

    Each step is cut into micro-batches of `micro_batch()` samples (the worker sizes them from its
    speed); `between()` runs before each (the worker's cancel and pause checks: it may raise), and
    `observe(samples, seconds)` after each. `model` is overwritten: it ends at the last step.
    """
    device = torch.device(device)
    model.load(initial)
    model.module.train()
    optimizer = job.build_optimizer(model.module.parameters())
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
            chunk = indices[position:min(hi, position + max(1, micro_batch()))]
            t0 = time.perf_counter()
            batch = batch_to(gather(train, chunk), device)
            loss = job.loss(model.module, batch)
            (loss * (len(chunk) / (hi - lo))).backward()  # the step's mean loss
            loss_sum += float(loss.detach()) * len(chunk)
            samples += len(chunk)
            position += len(chunk)
            if observe is not None:
                observe(len(chunk), time.perf_counter() - t0)
        optimizer.step()
    change = initial.to(model.params.device, copy=True).sub_(model.params)
    change.mul_(coefficient * samples)
    return LocalChange(change, loss_sum, samples)
