"""The job a welcome names, built on this machine from its own code: the device, the job's spec,
the owner's memory limits (checked before and after building), the engine that computes it, the
models its tasks carry, and the results its computations come to (for the session); and what this
machine says of itself in its hello.
Nothing executable crosses the network: a welcome names a built-in job or the one this worker
was started with (`--job SPEC`)."""

from __future__ import annotations

import dataclasses
import platform
import socket
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from .. import __version__
from ..common import protocol as proto
from ..common.errors import ConfigError, ProtocolError, Refused
from ..common.tensors import blob_chunks, buffer_vector
from ..common.job import BuiltJob, Job, build, epoch_order, job_differences, model_bytes
from ..common.job_loading import builtin_job_names, load_job, local_path_args
from ..common.text import shown
from . import session as S
from .compress import ErrorFeedback, eval_message, result_message
from .engine import Engine, Outcome, SnapshotRef, Work
from .config import usable_cores
from .idle import memory_left_mb

# Copies of the model a worker holds at once: flat parameters and gradients, a model received
# from the wire, a local task's optimizer moments (Adam's two); one gradient buffer per credit.
MODEL_COPIES = 5


def pick_device(wanted: str) -> torch.device:
    if wanted == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(wanted)
    except RuntimeError:
        raise ConfigError(f"device {wanted!r} unknown: use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {wanted!r} asked for, but torch sees no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {wanted!r} is not supported: use cpu or cuda[:N]")
    return device


def job_key(welcome: proto.Welcome) -> tuple:
    """What a built job depends on: two welcomes of one key need one build."""
    return (welcome.job, tuple(sorted(welcome.job_args.items())), welcome.seed,
            welcome.shuffle_window)


def load_welcomed(configured: Optional[str], welcome: proto.Welcome) -> Job:
    """The job a welcome names, from this machine's code (`configured`: the worker's --job)."""
    if configured is None and welcome.job not in builtin_job_names():
        raise Refused(f"the coordinator trains job {welcome.job!r}, which is not built in; "
                      "start this worker with --job SPEC naming that job's code on this machine")
    paths = local_path_args(welcome.job_args)
    if paths:  # before the job is built: building reads what its arguments name
        raise Refused("the coordinator's job arguments name paths on this machine ("
                      + ", ".join(f"{name}={shown(welcome.job_args[name])}" for name in paths)
                      + "): refused before reading them; a job's data comes by manifest (--data)")
    return load_job(configured or welcome.job, welcome.job_args)


def build_engine(job: Job, welcome: proto.Welcome, config, device: torch.device,
                 store=None) -> tuple[BuiltJob, Engine]:
    """Build `job` (its data from `store` when it declares its data by manifest) within the
    owner's memory limits, and its engine; `config`: the WorkerConfig (credits, policy, faults)."""
    check_memory(job, config)
    built = build(job, device=device, store=store)
    check_memory(job, config, built)
    engine = Engine(built, epoch_order(built.train, welcome.seed, welcome.shuffle_window), device)
    engine.slowdown, engine.stall, engine.poison = config.slowdown, config.stall, config.poison
    engine.store = store
    if job.data is None:  # data by manifest is read through fetches the session drives
        engine.warm_up()
    return built, engine


class OtherJob(Refused):
    """The job built here is not the coordinator's (another fingerprint)."""


def check_same_job(built: BuiltJob, welcome: proto.Welcome) -> None:
    """Another model under the job's name (another version of its code, or of idlegrad): its
    gradients would be of no use, so say what differs (OtherJob) instead of joining."""
    if built.fingerprint == welcome.fingerprint:
        return
    if welcome.job_identity is None:  # a coordinator that does not say
        raise OtherJob(f"job fingerprint {built.fingerprint} here, {welcome.fingerprint} at the "
                       "coordinator: refused to compute for another version of the job")
    differs = job_differences(built.identity, welcome.job_identity, "here", "at the coordinator")
    raise OtherJob(f"job {built.job.name!r} here is not the coordinator's "
                   f"({'; '.join(differs) or 'fingerprints differ'}): start this worker with the "
                   "coordinator's job and version")


def refusal_message(exc: Exception, built: Optional[BuiltJob],
                    welcome: proto.Welcome) -> tuple[proto.Message, bool]:
    """What to tell a coordinator whose job this worker cannot run (`exc`), and whether to await
    its answer: having built another job, what it built (a READY of no credits with its
    identity), for the coordinator to say what differs; else a BYE that says why."""
    if isinstance(exc, OtherJob) and welcome.job_identity is not None and built is not None:
        return proto.Ready(credits=0, fingerprint=built.fingerprint,
                           job_identity=proto.job_identity_or_none(built.identity)), True
    return proto.Bye(reason=str(exc)[:500]), False


def check_memory(job: Job, config, built: Optional[BuiltJob] = None) -> None:
    """Refuse a job the owner's memory limits have no room for. The coordinator chooses the
    job's arguments, so it chooses its size: before building, the model is measured on the
    meta device (nothing allocated) and counted as every copy the worker will hold; after,
    what building took (data sets too) is in the worker's resident memory, and the copies
    still to come are added. A factory that allocates by itself is seen only after."""
    copies = MODEL_COPIES + config.credits
    if built is None:
        per_copy = model_bytes(job)
        if per_copy is None:
            return  # not measurable without building it: measured after
    else:
        model = built.model
        per_copy = model.params.nbytes + sum(b.nbytes for b in model.module.buffers())
        copies -= 2  # its parameters and gradients are built
    need_mb = per_copy * copies / 2**20
    left_mb = memory_left_mb(config.policy, psutil.Process().memory_info().rss / 2**20,
                             psutil.virtual_memory().available / 2**20)
    if need_mb > left_mb:
        needs = "needs" if built is None else "once built, needs"
        raise Refused(
            f"job {job.name!r} with the coordinator's arguments {needs} {need_mb:,.0f} MiB "
            f"more ({copies} copies of a {per_copy / 2**20:,.1f} MiB model), and this worker "
            f"may take {max(0.0, left_mb):,.0f} MiB more (the owner's --memory-max and the "
            "memory the machine has free): refused")


def hello_of(worker_id: str, threads: int, device: torch.device, job: Optional[str]) -> proto.Hello:
    return proto.Hello(
        worker_id=worker_id, host=socket.gethostname(), cores=usable_cores(), threads=threads,
        device=str(device), memory_mb=psutil.virtual_memory().total // 2**20,
        versions={"idlegrad": __version__, "torch": torch.__version__,
                  "python": platform.python_version(), "protocol": str(proto.PROTOCOL_VERSION),
                  # it reads a job's identity: told one, it can say what differs
                  "job_identity": proto.JOB_IDENTITY_FORMAT},
        job=job)


def task_model(task: proto.Task, model) -> tuple:
    """(parameters as views of the task's frames, buffers or None) of the model a task carries,
    checked against the built `model` (a FlatModel); ProtocolError when it is not that model."""
    params = blob_chunks(task.model, model.numel, model.dtype)
    if not (model.buffers or task.buffers is not None):
        return params, None
    if task.buffers is None:
        raise ProtocolError("tensor", "no buffers with the model")
    return params, buffer_vector(task.buffers, model.buffer_numel, model.counter_mask)


def held_model(task: proto.Task, held: Optional[tuple], model) -> Optional[tuple]:
    """The model a task computes on, as (version, parameters, buffers, snapshot): the one it
    carries (checked against the built `model`: ProtocolError), the snapshot it names, or the
    one `held` from an earlier task."""
    if task.snapshot is not None:
        return (task.version, None, None, SnapshotRef(task.snapshot, task.snapshot_bytes))
    if task.model is not None:
        params, buffers = task_model(task, model)
        return (task.version, params, buffers, None)
    return held


def task_work(task: proto.Task, held: Optional[tuple], arrived: float) -> Optional[Work]:
    """The work of `task` on the `held` model; None when that is not the model it names."""
    if held is None or held[0] != task.version:
        return None
    _, params, buffers, snapshot = held
    return Work(task.slot, task.version, params, task.parts, task.coefficients, task.kind,
                task.steps, arrived=arrived, buffers=buffers, snapshot=snapshot)


@dataclass
class Kept:
    """A result until acknowledged: its message, its gradient buffer, trackers of its sends."""
    message: proto.Result
    gradient: torch.Tensor
    trackers: list = dataclasses.field(default_factory=list)


def session_outcome(outcome: Outcome, work: Work, began: float,
                    wire: ErrorFeedback) -> tuple[S.Outcome, float]:
    """What the computation of `work` that began at `began` came to, for the session (an
    evaluation's answer, or a result kept until acknowledged, as the coordinator wants it:
    `wire`); its compute seconds."""
    waited = max(0.0, began - work.arrived) if work.arrived is not None else 0.0
    o = dataclasses.replace(outcome, waited_s=waited)
    if o.sums is not None:
        return S.EvalAnswer(eval_message(o)), o.compute_s
    return S.ResultReady(Kept(result_message(o, wire), o.gradient)), o.compute_s
