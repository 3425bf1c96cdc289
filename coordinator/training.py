"""The coordinator's composition root: from the checked configuration (and a checkpoint, when
resuming) it builds the job, the model, the round core, the run core (evaluations, the target,
the stop), the data plane and the credits, and it keeps what the server reports: events, the
evaluation curve, metrics records, checkpoints, the welcome and task messages.

No sockets: the server owns the socket, the loop and the threads (`evaluation()` hands it a
callable to run in one). It does read clocks: the wall clock for event and metrics times and the
run's instance name, and at start it times a few samples (the evaluation's and a gradient's
cost, for `--eval-on auto`); `now`, the loop's monotonic time, is passed in.
"""

from __future__ import annotations

import gc
import logging
import os
import socket as pysocket
import time
from collections import Counter, deque
from functools import partial
from typing import Callable, Optional

import torch

from ..common import protocol as proto
from ..common.errors import CheckpointError, ConfigError, JobError
from ..common.job_loading import welcome_args
from ..common.text import shown
from ..common.job import (build, build_schedule, epoch_order, eval_size, evaluate,
                          evaluation_sums, load_job, make_optimizer, reference_gradient_norm,
                          resolve_factory, summed_loss_warning, sums_evaluable)
from ..common.permutation import ShardOrder, epoch_blocks
from ..common.job import FlatModel, job_differences
from . import checkpoint, dataplane, outer
from .batch_policy import Batching, resolve_lr_rule
from .effects import Applied
from .rates import AppliedRates
from .config import Checked, CoordinatorConfig, naming_job_args
from .credits import Credits
from .effects import Event
from .eval_slots import EVAL_SLOT_BATCHES, EvalChoice, EvalShape, choose, plan_ranges
from .evaluation import BAD_TARGET, TARGET
from .locality import Locality, group_for
from .model_state import ModelState
from .rounds import RoundCore
from .run import RunCore
from .sampler import Sampler
from .scheduler import Assign, Scheduler, SchedulerConfig
from .status import CURVE_POINTS
from .target import Target
from .trust import TrustPolicy

log = logging.getLogger("idlegrad.coordinator")


def tune_gc() -> None:
    """What start-up built (torch, the job, the model) is frozen out of collections, and full
    passes come less often: Python's default costs the scheduler about a third of its time per
    slot at 10,000 workers, and the coordinator's records hold few reference cycles."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)


MAX_EVENT_TEXT = 2000  # an event's text, cut past this: a few workers' ids and reasons


class Training:
    EVENTS_KEPT = 1000

    def __init__(self, config: CoordinatorConfig, checked: Checked, copy_threshold_bytes: int = 0):
        self.config = config
        self.task_mode = checked.task_mode
        self.mode = checked.mode  # synchronous or asynchronous rounds, and why (mode.py)
        if config.threads:
            torch.set_num_threads(config.threads)
        # The data a job declares by manifest: the pack served here (--data DIR), whose
        # manifest's hash the job's factory is given as `data`, and so every worker too.
        pack = dataplane.open_pack(config.data_dir) if config.data_dir else None
        self.job_args = dict(config.job_args)
        try:
            if pack is not None:
                self.job_args = dataplane.job_args_with_data(
                    resolve_factory(config.job), self.job_args, pack[0])
            job = load_job(config.job, self.job_args)
            if pack is None and job.data is None and job.pack is not None:
                pack_dir = job.pack()
                log.info("serving job %s's own pack %s", job.name, pack_dir)
                pack = dataplane.open_pack(pack_dir, "the job's pack")
                self.job_args = dataplane.job_args_with_data(
                    resolve_factory(config.job), self.job_args, pack[0], "the job's pack")
                job = load_job(config.job, self.job_args)
            if pack is not None and job.data != pack[0].sha256:
                raise ConfigError(
                    f"--data {config.data_dir}: job {job.name!r} does not train on it (it declares "
                    f"{'no data' if job.data is None else 'manifest ' + str(job.data)[:12]}; a "
                    "job takes its pack through a `data` argument, as the built-in packed does)")
            self.built = build(job, seed=config.seed, store=pack[1] if pack is not None else None)
        except JobError as exc:
            raise naming_job_args(exc, self.job_args) from None
        # A large model goes by name (snapshots.py): its snapshots are blobs served here too.
        self.data = dataplane.DataPlane.for_run(
            pack, self.built.model.params.nbytes, config.snapshot_min_mb, self.task_mode.local,
            config.blob_mirrors, config.snapshot_dir, job.name)
        if self.data.service is not None:  # one key's fetches waiting, all its names together
            self.data.service.queue_per_owner = config.budgets.fetches
        if config.target is not None:
            self._check_target(config.target)
        module = self.built.model.module
        if self.task_mode.local and (job.lr_lambda or job.build_scheduler):
            raise ConfigError(f"job {job.name!r} has a learning-rate schedule, which steps the "
                              "coordinator's optimizer: use --task gradient (with --task local the "
                              "job's optimizer is built afresh on the workers for every slot)")
        if self.task_mode.local:
            optimizer, schedule = outer.build(module.parameters(), config.outer), None
        else:
            optimizer = make_optimizer(job, module)
            schedule = build_schedule(job, optimizer)
        self.elapsed_before = 0.0  # training time of earlier runs resumed from a checkpoint
        self.metrics: dict[str, float] = {}
        state = checkpoint.load(config.checkpoint_dir) if config.checkpoint_dir else None
        window = config.shuffle_window if config.locality else 0
        if state is not None:
            window = self._resume_order(state, window)
        # The order every side reads the training set in (the welcome's shuffle_window)
        self.order = epoch_order(self.built.train, config.seed, window)
        self.loss_warning = summed_loss_warning(job, self.built.model.module, self.built.train,
                                                self.order)
        if self.loss_warning:
            log.warning("%s", self.loss_warning)
        sharded = isinstance(self.order, ShardOrder)
        self.sampler = Sampler(len(self.built.train), config.epochs,
                               blocks=partial(epoch_blocks, self.order) if sharded else None)
        version, next_id, samples = 0, 1, 0
        if state is not None:
            version, next_id, samples = self._resume(state)
        # Local tasks clip each inner step on the worker; the round's outer change is no gradient
        self.model = ModelState(self.built, optimizer, config.staleness, self.order,
                                config.result_dtype, version, copy_threshold_bytes, schedule,
                                None if self.task_mode.local else job.clip_norm,
                                compensation=checked.compensation)
        if state is not None:
            kind = state.get("task_kind", "gradient")
            if kind != self.task_mode.kind:  # the job's optimizer and the outer one share no state
                log.warning("the checkpoint was trained with %s tasks: its optimizer state is "
                            "not carried over to %s tasks", kind, self.task_mode.kind)
            self.model.load(state, with_optimizer=kind == self.task_mode.kind)
        scheduler = Scheduler(
            SchedulerConfig(batch_size=job.batch_size, partitions=config.partitions,
                            open_rounds=config.open_rounds, pipeline=config.pipeline,
                            heartbeat_s=config.heartbeat_s,
                            liveness=config.liveness, min_deadline_s=config.min_deadline_s,
                            pause_grace_s=config.pause_grace_s, redundancy=checked.redundancy,
                            sync=checked.mode.sync, max_batch=config.max_batch,
                            speculate=config.speculate, verify_replicas=config.verify_replicas,
                            min_workers=config.min_workers),
            self.sampler, version=version, next_id=next_id, task_mode=self.task_mode,
            locality=Locality(self.order, group_for(checked.redundancy)) if sharded else None)
        self.eval_choice = self._choose_eval_on()
        batching = Batching(checked.batch, resolve_lr_rule(config.batch_lr,
                                                           type(optimizer).__name__),
                            job.batch_size, config.max_batch)
        if batching.adaptive:  # the job's schedule counts base-batch steps (aggregator.py)
            self.model.aggregator.progress_base = job.batch_size
        if state is not None:
            batching.load_state_dict(state.get("batching"))
        self.core = RoundCore(scheduler, self.model, self._trust(), samples_applied=samples,
                              settle_on_workers=self.settle_on == "workers", batching=batching)
        if state is not None and isinstance(state.get("noise"), dict):
            self.core.noise.load_state_dict(state["noise"])
        # saved with the model, so that after a crash they are the checkpoint's, as the samples
        self.credits = Credits.from_state(state.get("credits") if state is not None else None)
        self.run = RunCore(self.core, self.eval_on, self.eval_parts(), config.eval_every,
                           config.target, self._eval_shape())
        self.bad_messages: Counter[str] = Counter()  # by reason
        self.events: deque[dict] = deque(maxlen=self.EVENTS_KEPT)
        self.event_id = 0
        self.curve: deque[dict] = deque(maxlen=CURVE_POINTS)  # recent evaluations, for monitors
        self.instance = f"{pysocket.gethostname()}-{os.getpid()}-{time.time():.3f}"
        self.started = 0.0  # scheduler time the serving began
        self.rates = AppliedRates()  # the status's samples/s, in all and per worker

    def applied(self, effect: Applied, now: float) -> None:
        """An applied round's used results, for the rates (by worker id, as status rows are)."""
        names = self.core.identity_names
        self.rates.applied(now, ((names.get(c.identity, c.identity), c.samples)
                                 for c in effect.credits))

    @property
    def shuffle_window(self) -> int:
        """What the welcome tells workers of the order: 0, the full shuffle; else the window."""
        return self.order.window if isinstance(self.order, ShardOrder) else 0

    @property
    def job(self):
        return self.built.job

    @property
    def fingerprint(self) -> str:
        return self.built.fingerprint

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def version(self) -> int:
        return self.model.version

    def elapsed(self, now: float) -> float:
        return self.elapsed_before + now - self.started

    def _trust(self) -> TrustPolicy:
        """Trust screening seeded with the norm of an honest gradient, computed here."""
        job = self.built.job
        scratch = FlatModel(job.build_model())
        scratch.load(self.built.model.params)
        try:
            reference = reference_gradient_norm(job, scratch, self.built.train, self.order)
        except Exception as exc:  # the job's own code: one line, not a traceback
            raise JobError(f"job {job.name!r}: its loss failed on the first training samples: "
                           f"{type(exc).__name__}: {exc}"[:500]) from None
        return TrustPolicy(self.config.trust, reference=reference)

    @property
    def eval_on(self) -> str:
        """Where evaluations run during the run: "workers" or "coordinator"."""
        return self.eval_choice.where

    @property
    def settle_on(self) -> str:
        """Who computes a slot to settle a dispute: "workers" or "coordinator". Under auto, where
        evaluations run: a model too costly to evaluate here is too costly to compute a slot of
        here (on lm tiny, settling suspects was half the coordinator's CPU)."""
        wanted = self.config.settle_on
        return self.eval_on if wanted == "auto" else wanted

    def eval_parts(self) -> list[list[int]]:
        """The test set's evaluated samples cut into evaluation slots' parts."""
        job = self.built.job
        return plan_ranges(eval_size(job, self.built.test), EVAL_SLOT_BATCHES * job.batch_size)

    def _eval_shape(self) -> Optional[EvalShape]:
        """What a worker's honest answer for a range of the test set looks like: the shape of
        the job's own sums of one and of a few test samples, computed here (None when
        evaluations stay here, or the job's code fails on them: any finite answer is taken)."""
        job, test = self.built.job, self.built.test
        few = min(8, eval_size(job, test))
        if self.eval_on != "workers" or few < 1:
            return None
        try:
            return EvalShape.of([(n, evaluation_sums(job, self.built.model.module, test, 0, n))
                                 for n in sorted({1, few})])
        except Exception:  # noqa: BLE001 - the job's own code: its evaluations will say
            return None

    def _choose_eval_on(self) -> EvalChoice:
        job, wanted = self.built.job, self.config.eval_on
        if wanted == "workers" and not sums_evaluable(job):
            raise ConfigError(f"--eval-on workers: job {job.name!r} has an evaluate that returns "
                              "means, which ranges of the test set cannot be added up from: give "
                              "the job an evaluate_sums, or use --eval-on coordinator")
        if wanted != "auto" or not sums_evaluable(job):
            return choose(wanted, sums_evaluable(job))
        return choose(wanted, True, *self._costs())

    def _costs(self) -> tuple[float, float]:
        """Estimates of one evaluation's seconds here (a few test samples timed, scaled to the
        evaluated count) and of the run's training seconds as this machine alone would take it
        (a few training samples' gradient timed, scaled to the epochs; one without --epochs)."""
        job, train, test = self.built.job, self.built.train, self.built.test
        scratch = FlatModel(job.build_model())
        scratch.load(self.built.model.params)
        if scratch.buffers:
            scratch.load_buffers(self.built.model.buffers_flat())
        total = eval_size(job, test)
        few = min(32, total)
        try:
            evaluation_sums(job, scratch.module, test, 0, min(4, few))  # warm-up
            t0 = time.perf_counter()
            evaluation_sums(job, scratch.module, test, 0, few)
            eval_s = (time.perf_counter() - t0) / max(1, few) * total
            count = min(32, len(train))
            t0 = time.perf_counter()
            reference_gradient_norm(job, scratch, train, self.order, count)
            run_s = (time.perf_counter() - t0) / count * len(train) * (self.config.epochs or 1)
        except Exception:  # noqa: BLE001 - the job's own code: the first evaluation will say
            return 0.0, 1.0
        return eval_s, run_s

    def _check_target(self, target: Target) -> None:
        """A target on a metric the job does not report is one line now, not an error after the
        first evaluation. The names come from evaluating a few test samples."""
        few = torch.utils.data.Subset(self.built.test, range(min(8, len(self.built.test))))
        try:
            names = evaluate(self.built.job, self.built.model.module, few).keys()
        except Exception:  # noqa: BLE001 - the job's own code: the first real evaluation will say
            return
        if target.metric not in names:
            raise ConfigError(f"--target {target}: the job reports no metric {target.metric!r}; "
                              f"its metrics are {', '.join(sorted(names))}")

    # events -----------------------------------------------------------------------------------

    def event(self, kind: str, text: str, worker: Optional[str] = None,
              level: int = logging.INFO) -> None:
        # ids, hosts and reasons in `text` came from the network: one line each, no escapes
        text, worker = shown(text, MAX_EVENT_TEXT), None if worker is None else shown(worker)
        self.event_id += 1
        self.events.append({"id": self.event_id, "time": time.time(), "kind": kind,
                            "worker": worker, "text": text})
        log.log(level, "%s: %s", kind, text)

    def record(self, event: Event) -> None:
        self.event(event.kind, event.text, event.worker, event.level)

    # what workers are told ---------------------------------------------------------------------

    def start_text(self, security_note: str) -> str:
        config = self.config
        return (f"job {self.job.name} at version {self.version}, listening on {config.bind} "
                f"({security_note}); evaluations on the {self.eval_on} "
                f"({self.eval_choice.reason}), disputes settled on the {self.settle_on}"
                + (f"; the first slot once {config.min_workers} workers have joined"
                   if config.min_workers > 1 else "")
                + (f"; WARNING: {self.loss_warning}" if self.loss_warning else ""))

    def resumes(self, hello: proto.Hello, same_key: bool) -> bool:
        """Whether `hello` is the same worker process back on a new connection, before its
        eviction (`same_key`: under the key it had): it keeps its slots, and resends the results
        it has not seen acknowledged."""
        return (hello.worker_id in self.scheduler.workers and hello.instance == self.instance
                and same_key)

    def welcome(self, holding: list[int], job_identity: bool = False) -> proto.Welcome:
        """`job_identity`: the worker reads one (it says so in its hello), so the welcome
        carries ours, and a worker that built another job can say what differs."""
        config = self.config
        return proto.Welcome(
            # the job's name, not the spec: no local paths to strangers
            job=self.job.name, job_args=welcome_args(self.job_args, self.job.data is not None),
            fingerprint=self.fingerprint,
            seed=config.seed, heartbeat_s=config.heartbeat_s, liveness=config.liveness,
            instance=self.instance, holding=holding, result_dtype=config.result_dtype,
            blob_mirrors=list(config.blob_mirrors), shuffle_window=self.shuffle_window,
            job_identity=proto.job_identity_or_none(self.built.identity) if job_identity else None)

    def task(self, action: Assign, acks: list[int]) -> tuple[proto.Task, bool]:
        """The task message of `action`, and whether to track its send (the model's frames
        are sent zero-copy and reused once sent)."""
        model_state = self.model
        model = model_state.blob(action.version) if action.send_model else None
        # a large model goes by name: the worker fetches it once, from a mirror if it can
        named = self.data.by_name(action.version, model_state) if model is not None else None
        snapshot, snapshot_bytes = named or (None, 0)
        if named is not None:
            model = None
        # A small model is copied into ZeroMQ at once: a tracker costs more than the copy
        track = model is not None and model.numel > model_state.copy_numel
        return proto.Task(
            slot=action.slot, round=action.round, version=action.version, parts=action.parts,
            coefficients=action.coefficients, deadline_s=min(action.deadline_s, 1e9), model=model,
            acks=acks, kind=action.kind, steps=action.steps,
            buffers=model_state.buffers_blob(action.version) if model is not None else None,
            prefetch=list(action.prefetch), snapshot=snapshot,
            snapshot_bytes=snapshot_bytes), track

    # evaluations --------------------------------------------------------------------------------

    def evaluation(self) -> Callable[[], tuple[int, int, dict, float]]:
        """A callable evaluating the model as it is now (run it in a thread: it works on a
        copy): (version, samples applied, metrics, seconds)."""
        run = self.model.evaluation()
        version, samples = self.version, self.core.samples_applied

        def timed():
            t0 = time.perf_counter()
            return version, samples, run(), time.perf_counter() - t0
        return timed

    def evaluated(self, result: tuple, source: str, now: float,
                  judge: bool = True) -> tuple[list, dict]:
        """An evaluation (version, samples applied, metrics, seconds) is done, made on `source`
        ("coordinator" or "workers"): counted, kept for the curve and, with `judge`, judged by
        the run core (run.py). Returns what the run core starts now (a confirming evaluation)
        and the metrics log's line."""
        version, samples, metrics, seconds = result
        self.core.counters["evaluations_" + source] += 1
        self.metrics = metrics
        self.curve.append({"t": round(self.elapsed(now), 3), "version": version,
                           "samples": samples, "loss": self.core.train_loss,
                           "metrics": dict(metrics)})
        outcome, start = self.run.evaluated(version, metrics, seconds, now, judge)
        target = self.run.target
        if outcome == BAD_TARGET:
            log.error("target metric %r is not among the job's metrics %s", target.metric,
                      sorted(metrics))
        elif outcome == TARGET:
            self.event("target", f"{target} reached at version {version}: "
                                 f"{target.metric}={metrics[target.metric]:.4f}")
        return start, self.metrics_record(now, version, samples, source)

    def metrics_record(self, now: float, version: Optional[int] = None,
                       samples: Optional[int] = None, source: Optional[str] = None) -> dict:
        """A line of the metrics log; `source`: where its evaluation ran (`eval_on`)."""
        core = self.core
        return {
            "time": time.time(), "elapsed": round(self.elapsed(now), 4),
            "version": self.version if version is None else version,
            "samples": core.samples_applied if samples is None else samples,
            "epoch": round(self.sampler.progress, 4), "loss": core.train_loss,
            "metrics": self.metrics, "workers": len(self.scheduler.workers),
            "samples_per_s": round(core.samples_per_s(now), 2),
            "bytes_per_sample": self.bytes_per_sample(), "task": str(self.task_mode),
            "noise": core.noise.summary(), "batch": core.batching.summary(),
            "mode": self.mode.name, "slot_spread": self.scheduler.slot_spread,
            **({"data": self.data.summary()} if self.data.service is not None else {}),
            **({"snapshots": self.data.snapshots_summary()}
               if self.data.snapshots is not None else {}),
            **({"eval_on": source} if source is not None else {}),
        }

    def final_record(self, now: float, reason: Optional[str]) -> dict:
        """The metrics log's last line: the run's tallies, for after the status endpoint is gone."""
        return dict(self.metrics_record(now), final=True, reason=reason,
                    counters=dict(self.core.counters), scheduler=dict(self.scheduler.stats),
                    trust=self.core.trust_summary())

    def refusal(self, worker_id: str, fingerprint: str,
                job_identity=None) -> Optional[proto.Reject]:
        """What `worker_id`, whose job's fingerprint is `fingerprint`, is told if it may not
        train (and logged here, naming what differs from `job_identity`, when it sent one)."""
        if fingerprint == self.fingerprint:
            return None
        differs = "; ".join(job_differences(self.built.identity, job_identity, "here",
                                            "on the worker")
                            if job_identity is not None else [])
        self.event("refused", f"{worker_id} built another job than this one: "
                              f"{differs or f'fingerprint {fingerprint}'}"[:500], worker_id,
                   logging.WARNING)
        reason = (f"this coordinator trains job {self.job.name!r} with fingerprint "
                  f"{self.fingerprint}; the worker built fingerprint {fingerprint}"
                  f"{f' ({differs})' if differs else ''}: start it with the same job and "
                  "version")[:proto.MAX_STR]
        return proto.Reject(code="job", reason=reason)

    def bytes_per_sample(self) -> Optional[float]:
        """Wire bytes, both ways, per sample applied."""
        samples = self.core.samples_applied
        if not samples:
            return None
        counters = self.core.counters
        return round((counters["bytes_sent"] + counters["bytes_received"]) / samples, 1)

    def close(self) -> None:
        self.data.close()

    # checkpoints ------------------------------------------------------------------------------

    def _resume_order(self, state: dict, window: int) -> int:
        """The checkpoint's data order (seed, shuffle window) rules: the plan it saved names
        positions in that order. Returns the window to use."""
        if state["seed"] != self.config.seed:
            log.warning("using the checkpoint's data seed %d, not %d", state["seed"],
                        self.config.seed)
            self.config.seed = int(state["seed"])
        saved = int(state.get("shuffle_window", 0))
        if epoch_order(self.built.train, 0, saved) != epoch_order(self.built.train, 0, window):
            log.warning("using the checkpoint's epoch order (%s), not %s",
                        f"shuffle window {saved}" if saved else "a full shuffle",
                        f"shuffle window {window}" if window else "a full shuffle")
        return saved

    def _resume(self, state: dict) -> tuple[int, int, int]:
        if state["fingerprint"] != self.built.fingerprint:
            raise CheckpointError(
                f"the checkpoint in {self.config.checkpoint_dir} is for job {state['job']!r} "
                f"(fingerprint {state['fingerprint']}), not this one ({self.built.fingerprint})")
        self.sampler.load_state_dict(state["sampler"])
        self.elapsed_before = float(state["elapsed"])
        self.metrics = {str(k): float(v) for k, v in state.get("metrics", {}).items()}
        log.info("resumed from %s at version %d (%d samples applied)",
                 checkpoint.path_in(self.config.checkpoint_dir), state["version"], state["samples"])
        return int(state["version"]), int(state["next_id"]), int(state["samples"])

    def save_checkpoint(self, now: float) -> Optional[str]:
        if not self.config.checkpoint_dir:
            return None
        sampler_state = self.sampler.state_dict()
        # Rounds still open are replanned on resume: their samples are not lost.
        sampler_state["replan"] = ([[list(p) for p in parts] for parts in self.scheduler.open_parts()]
                                   + sampler_state["replan"])
        state = {
            "job": self.built.job.name,
            "fingerprint": self.built.fingerprint,
            "version": self.version,
            **self.model.state(),
            "task_kind": self.task_mode.kind,  # whose state "optimizer" is: the job's or the outer
            "sampler": sampler_state,
            "seed": self.config.seed,
            "shuffle_window": self.shuffle_window,
            "samples": self.core.samples_applied,
            "next_id": self.scheduler.next_id(),
            "elapsed": self.elapsed(now),
            "metrics": dict(self.metrics),
            "credits": self.credits.state_dict(),
            # the batch policy and the noise estimates it follows (--batch adaptive)
            "batching": self.core.batching.state_dict(),
            "noise": self.core.noise.state_dict(),
        }
        try:
            path = checkpoint.save(self.config.checkpoint_dir, state)
        except OSError as exc:  # a full disk: the model is in memory, and the old checkpoint kept
            self.event("disk", f"checkpoint of version {self.version} not saved in "
                       f"{self.config.checkpoint_dir} ({exc.strerror or exc}): training goes on "
                       "from memory, the next save tries again", level=logging.ERROR)
            return None
        self.core.counters["checkpoints"] += 1
        self.event("checkpoint", f"version {self.version} saved")
        return path
