"""The coordinator's settings, checked once, before anything is built or bound: a wrong value is
one line (ConfigError), never a traceback after start-up."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from ..common import coding
from ..common import protocol as proto
from ..common import security
from ..common.coding import Redundancy
from ..common.errors import ConfigError, JobError
from . import local
from .batch_policy import BatchSetting, parse_batch, parse_lr_rule
from .budgets import BudgetConfig
from .staleness import (NO_COMPENSATION, DelayCompensation, StalenessRule,
                        parse_delay_compensation)
from .gate import KeyLists
from .local import OuterConfig, TaskMode
from .mode import Mode
from .mode import resolve as resolve_mode
from .scheduler import SchedulerConfig
from .target import Target
from .trust import TrustConfig, check_verify_replicas

log = logging.getLogger("idlegrad.coordinator")


@dataclass
class CoordinatorConfig:
    job: str
    job_args: dict[str, Any] = field(default_factory=dict)
    bind: str = "tcp://127.0.0.1:5555"
    checkpoint_dir: Optional[str] = None
    checkpoint_every: float = 60.0
    metrics_path: Optional[str] = None
    epochs: Optional[int] = None
    target: Optional[Target] = None
    seed: int = 0
    heartbeat_s: float = 1.0
    liveness: int = 3
    partitions: int = 1
    open_rounds: int = 0
    pipeline: int = 1  # sync rounds open at once (SchedulerConfig)
    min_workers: int = 1  # no slot before this many workers have joined (once)
    staleness: StalenessRule = field(default_factory=StalenessRule)
    # stale rounds' gradients corrected towards the current model: off | dc[:L] | dc-a[:L]
    # (compensation.py); off until it is measured to pay (docs/scaling.md)
    delay_compensation: str = "off"
    eval_every: Optional[float] = None  # None: adaptive, at most ~10% of the time
    # where evaluations run: workers | coordinator | auto (coordinator/eval_slots.py `choose`)
    eval_on: str = "auto"
    # who computes a slot to settle a suspect or a disagreement: coordinator | workers (verify.py)
    # | auto (where evaluations run)
    settle_on: str = "auto"
    min_deadline_s: float = 30.0
    threads: Optional[int] = None
    pause_grace_s: float = 5.0  # a worker paused by its owner keeps its slots this long
    redundancy: str = "none"  # none | replicate:R | cyclic:S | adaptive (coding.parse_redundancy)
    # auto | sync | async (mode.py): synchronous rounds, one sized part per ready worker, unless
    # the other settings ask for asynchronous ones
    mode: str = "auto"
    max_batch: Optional[int] = None  # cap on a round's batch
    # fixed (the job's batch) | adaptive[:MAX] (towards the gradient noise scale: batch_policy.py)
    batch: str = "fixed"
    # the learning rate of a step of a larger batch: auto | sqrt | adascale | linear | none
    batch_lr: str = "auto"
    speculate: bool = True  # duplicate late slots to free workers
    secret_key: Optional[str] = None  # CURVE: this coordinator's NAME.key_secret file
    allow_keys: Optional[str] = None  # CURVE: directory of the workers' NAME.key files
    monitor_keys: Optional[str] = None  # CURVE: keys that may read the status
    operator_keys: Optional[str] = None  # CURVE: keys that may read the status and command
    enrolled: Optional[str] = None  # CURVE: invitations and the keys they enrolled (work role)
    insecure: bool = False  # without keys, listen beyond loopback anyway
    trust: TrustConfig = field(default_factory=TrustConfig)  # outlier gradients, offences, bans
    budgets: BudgetConfig = field(default_factory=BudgetConfig)  # what one key may cost
    ledger_path: Optional[str] = None  # JSON lines: slots sent, results acknowledged, rounds applied
    task: str = "gradient"  # gradient | local:H | local:auto (local.parse_task)
    outer: OuterConfig = field(default_factory=OuterConfig)  # local tasks' outer optimizer
    local_slot_s: float = 5.0  # local:auto: the least compute seconds of a slot
    local_max_steps: int = 500  # local:auto: at most this many inner steps per slot
    local_link_factor: float = local.TaskMode.link_factor  # local:auto: compute / link seconds
    result_dtype: str = "float32"  # results on the wire: float32 or bfloat16 (workers round)
    verify_replicas: bool = False  # a replicated row counts once two copies of it agree
    data_dir: Optional[str] = None  # a pack (idlegrad data pack --out) whose blobs are served
    blob_mirrors: tuple[str, ...] = ()  # http(s) mirrors of those blobs, told to workers
    # Sharded training data: read each epoch in the shard-aware order (shards shuffled, samples
    # within blocks of `shuffle_window` shards) and prefer slots whose shards a worker holds.
    # Data that is not sharded keeps the full shuffle whatever this says.
    locality: bool = True
    shuffle_window: int = 2
    # a model of at least this many MB of parameters goes to workers as a snapshot blob
    # (snapshots.py); None: 8, or 1 with local tasks and a mirror
    snapshot_min_mb: Optional[float] = None
    snapshot_dir: Optional[str] = None  # where snapshot blobs are written; None: a temporary one


EVAL_ON = ("auto", "workers", "coordinator")
SETTLE_ON = ("auto", "coordinator", "workers")


@dataclass(frozen=True)
class Checked:
    """What the checks found: the parsed forms the coordinator is built from."""

    task_mode: TaskMode
    redundancy: Redundancy
    keypair: Optional[tuple[bytes, bytes]]  # CURVE: (public, secret); None without keys
    keys: Optional[KeyLists]  # CURVE: who holds which role; None without keys
    compensation: DelayCompensation = NO_COMPENSATION  # --delay-compensation, parsed
    mode: Mode = Mode(False, "--async")  # synchronous or asynchronous rounds, and why
    batch: BatchSetting = BatchSetting()  # --batch, parsed

    @property
    def allowed(self) -> Optional[frozenset[bytes]]:
        """The worker keys; None without keys."""
        return None if self.keys is None else self.keys.workers


def check(config: CoordinatorConfig) -> Checked:
    """Every setting, in the order a user would fix them; ConfigError with one line."""
    keypair, keys = _check_security(config)
    low, high = proto.HEARTBEAT_S_RANGE
    if not low <= config.heartbeat_s <= high:
        raise ConfigError(f"--heartbeat must be from {low:g} to {high:g} seconds (workers "
                          f"refuse a welcome outside that), not {config.heartbeat_s:g}")
    task_mode = local.parse_task(config.task, config.local_slot_s,
                                 max_steps=config.local_max_steps,
                                 link_factor=config.local_link_factor)
    redundancy = coding.parse_redundancy(config.redundancy)
    compensation = parse_delay_compensation(config.delay_compensation)
    if compensation.on and task_mode.local:
        raise ConfigError("--delay-compensation corrects gradients: local tasks send parameter "
                          "changes (use it with --task gradient)")
    coding.check_result_dtype(redundancy, config.result_dtype)
    mode = resolve_mode(config.mode, local_tasks=task_mode.local, redundancy=str(redundancy),
                        verify_replicas=config.verify_replicas, partitions=config.partitions,
                        open_rounds=config.open_rounds, compensation=compensation.on)
    if mode.sync and redundancy.kind != "none":
        raise ConfigError(f"--redundancy {redundancy} cannot be used with --sync: synchronous "
                          "rounds are one part per worker, without copies or coded rows (without "
                          "--sync, --redundancy runs asynchronous rounds)")
    local.check_redundancy(task_mode, redundancy, mode.sync)
    batch = _check_batch(config, task_mode)
    # the scheduler's own rules between its options, before the job is built (the real
    # SchedulerConfig needs the job's batch size)
    SchedulerConfig(batch_size=1, redundancy=redundancy, sync=mode.sync,
                    verify_replicas=config.verify_replicas, pipeline=config.pipeline)
    if config.pipeline > 1:
        mode = replace(mode, reason=f"{mode.reason}; {config.pipeline} rounds pipelined "
                                    "(--pipeline)")
    if config.verify_replicas:
        check_verify_replicas(config.result_dtype)
    if not 1 <= config.shuffle_window <= proto.MAX_SHUFFLE_WINDOW:
        raise ConfigError(f"--shuffle-window must be from 1 to {proto.MAX_SHUFFLE_WINDOW} "
                          f"shards, not {config.shuffle_window}")
    if config.eval_on not in EVAL_ON:
        raise ConfigError(f"--eval-on must be one of {', '.join(EVAL_ON)}, not "
                          f"{str(config.eval_on)[:40]!r}")
    if config.settle_on not in SETTLE_ON:
        raise ConfigError(f"--settle-on must be one of {', '.join(SETTLE_ON)}, not "
                          f"{str(config.settle_on)[:40]!r}")
    _check_paths(config)
    _check_data(config)
    return Checked(task_mode, redundancy, keypair, keys, compensation, mode, batch)


def _check_batch(config: CoordinatorConfig, task_mode: TaskMode) -> BatchSetting:
    batch = parse_batch(config.batch)
    parse_lr_rule(config.batch_lr)
    if batch.adaptive and task_mode.local:
        raise ConfigError("--batch adaptive grows rounds of gradients: local tasks are sized by "
                          "their steps (use it with --task gradient)")
    if not batch.adaptive and config.batch_lr != "auto":
        raise ConfigError(f"--batch-lr {config.batch_lr} scales the learning rate of a larger "
                          "batch: it needs --batch adaptive")
    return batch


def _check_paths(config: CoordinatorConfig) -> None:
    """Where the coordinator writes, made ready before anything starts: a path it cannot write
    is one line now, not a traceback after binding (or checkpoints that never save)."""
    flag = ""
    path: Optional[str] = ""  # the one that failed, for the message
    try:
        if config.checkpoint_dir:
            flag, path = "--checkpoint-dir", config.checkpoint_dir
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        for flag, path in (("--metrics", config.metrics_path), ("--ledger", config.ledger_path)):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                open(path, "a").close()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from None


def _check_data(config: CoordinatorConfig) -> None:
    """(Whether a mirror has anything to serve, --data or model snapshots, is known once the
    model is built: training.py.)"""
    if config.snapshot_min_mb is not None and not (0 <= config.snapshot_min_mb < float("inf")):
        raise ConfigError(f"--snapshot-min-mb must be a number of MB >= 0, not "
                          f"{config.snapshot_min_mb!r}")
    if config.snapshot_dir:
        try:
            os.makedirs(config.snapshot_dir, exist_ok=True)
            if not os.access(config.snapshot_dir, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as exc:
            raise ConfigError(f"--snapshot-dir {config.snapshot_dir}: cannot write there: "
                              f"{exc.strerror or exc}") from None
    if len(config.blob_mirrors) > proto.MAX_MIRRORS:
        raise ConfigError(f"--blob-mirror: at most {proto.MAX_MIRRORS} mirrors")
    for url in config.blob_mirrors:
        try:
            proto.check_blob_mirror(url, "--blob-mirror")
        except proto.ProtocolError as exc:
            raise ConfigError(exc.detail) from None
    if config.data_dir and not os.path.isdir(config.data_dir):
        raise ConfigError(f"--data {config.data_dir}: no such folder (the --out of idlegrad "
                          "data pack)")


def load_key_lists(config: CoordinatorConfig) -> KeyLists:
    """The key folders, read now (at start and on SIGHUP); ConfigError with one line."""
    assert config.allow_keys is not None  # keys come with --allow-keys (_check_security)
    enrolled: frozenset[bytes] = frozenset()
    if config.enrolled:
        from .enrolment import Store

        enrolled = Store(config.enrolled).prepare().enrolled_keys()
    return KeyLists(
        workers=security.load_allowed(config.allow_keys, "--allow-keys",
                                      empty_ok=bool(config.enrolled)) | enrolled,
        monitors=(security.load_allowed(config.monitor_keys, "--monitor-keys")
                  if config.monitor_keys else frozenset()),
        operators=(security.load_allowed(config.operator_keys, "--operator-keys")
                   if config.operator_keys else frozenset()))


def _make_key_folder(flag: str, folder: Optional[str]) -> None:
    """The workers' key folder, made (empty) when it does not exist yet, and said so: the README's
    first commands name it before any key is in it. Only at start (a folder gone at SIGHUP
    admits nobody until it is back), and not the monitors' or operators' (named on purpose, a
    missing one is a mistyped path)."""
    if folder is None or os.path.lexists(folder):
        return
    try:
        os.makedirs(folder)
    except OSError as exc:
        raise ConfigError(f"{flag} {folder}: cannot make it: {exc.strerror or exc}") from None
    log.warning("%s %s did not exist: made it, empty; copy each key's public NAME%s file there, "
                "then send this coordinator SIGHUP (kill -HUP %d) to read it", flag, folder,
                security.PUBLIC_SUFFIX, os.getpid())


def _check_security(config: CoordinatorConfig):
    """The CURVE key pair and key folders, or (None, None) for a plain loopback coordinator."""
    security.check_address(config.bind, "--bind", bind=True)
    if (config.secret_key is None) != (config.allow_keys is None):
        raise ConfigError("--secret-key and --allow-keys go together: give both or neither")
    if config.enrolled and config.secret_key is None:
        raise ConfigError("--enrolled needs --secret-key and --allow-keys: invitations enrol "
                          "CURVE keys")
    if config.enrolled:
        from ..common.invitation import enrol_address

        enrol_address(config.bind)  # a tcp:// address with a fixed port, or one line
    if config.secret_key is None and (config.monitor_keys or config.operator_keys):
        flag = "--operator-keys" if config.operator_keys else "--monitor-keys"
        raise ConfigError(f"{flag} needs --secret-key and --allow-keys: roles belong to CURVE "
                          "keys (without keys anyone on this machine may do anything)")
    if config.secret_key is not None:
        keypair = security.load_keypair(config.secret_key)
        _make_key_folder("--allow-keys", config.allow_keys)
        return keypair, load_key_lists(config)
    if not security.is_loopback(config.bind):
        if not config.insecure:
            raise ConfigError(
                f"refusing to listen on {config.bind} without keys: anyone who reaches it could "
                "train your model; give --secret-key and --allow-keys (see `idlegrad keys "
                "generate`), bind to 127.0.0.1, or say --insecure")
        log.warning("listening on %s WITHOUT encryption or authentication (--insecure): "
                    "anyone who can reach it may join and send gradients", config.bind)
    return None, None


def naming_job_args(exc: JobError, job_args: dict) -> JobError:
    """A job that failed to build says so in its own terms (a torch error about a tensor's size,
    say); the --job-arg values it was given are usually the cause, so the line names them."""
    if not job_args:
        return exc
    given = " ".join(f"--job-arg {k}={v!r}" for k, v in job_args.items())
    return JobError(f"{exc} (given {given})")
