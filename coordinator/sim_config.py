"""What a simulation (simulator.py) is asked, and what it answers: the settings of one run
(`SimConfig`, the coordinator's costs) and one mode's figures (`ModeResult`). Plain records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .run import WORKERS


@dataclass(frozen=True)
class CoordinatorCosts:
    """What the coordinator's own work costs: CPU seconds per message taken in (decode,
    schema checks, the scheduler, the reply), and its throughput in bytes/s for tensors (a
    gradient taken in and checked, a model sent, a round's weighted sum and optimizer step).
    Defaults from `benchmarks/scheduler_scale.py --costs` on this machine (see docs/scaling.md)."""

    per_message_s: float = 60e-6
    bytes_per_s: float = 1.5e9


@dataclass
class SimConfig:
    duration_s: float = 3600.0
    batch_size: int = 1024
    partitions: int = 8
    open_rounds: int = 0
    redundancy: str = "none"  # none | replicate:R | cyclic:S | adaptive | sync
    speculate: bool = True
    heartbeat_s: float = 1.0
    liveness: int = 3
    task_timeout_s: float = 30.0
    staleness: str = "inverse"
    max_staleness: int = 32
    model_bytes: int = 4_000_000  # parameters x 4 (float32): a gradient is as large
    train_samples: int = 60_000  # for costless gradients: the data set the sampler plans over
    costs: CoordinatorCosts = CoordinatorCosts()
    target_samples: Optional[int] = None  # stop once this many samples are applied
    # virtual seconds between evaluations (the run core's, on the workers' evaluation slots);
    # None: none, unless there is a target (then the coordinator's adaptive cadence)
    eval_every_s: Optional[float] = None
    test_samples: int = 10_000  # for costless gradients: the test set an evaluation covers
    sample_every_s: Optional[float] = None  # the time series' step (default: duration / 200)
    bye_fraction: float = 0.0  # departures that say bye (the rest vanish silently)
    startup_s: float = 0.0  # from a session's start to its hello (process start-up)
    warmup_s: float = 0.0  # the scheduler's cost per slot and per heartbeat is counted after this
    verify_replicas: bool = False  # with replicate:R, a row counts once two copies agree
    task: str = "gradient"  # what a slot computes: gradient | local:H | local:auto
    seed: int = 0
    shards: int = 0  # the training set in this many equal shards that workers fetch; 0: local data
    shard_bytes: int = 64 * 2**20
    locality: bool = True  # sharded data: the shard-aware order and the scheduler's preference
    shuffle_window: int = 4  # shards whose samples are shuffled together
    cache_shards: Optional[int] = None  # shards a worker's cache keeps; None: no limit
    batch: str = "fixed"  # fixed | adaptive[:MAX] (batch_policy.py; real gradients measure noise)
    batch_lr: str = "auto"  # the learning-rate rule of --batch adaptive


@dataclass
class ModeResult:
    mode: str
    duration_s: float  # virtual seconds simulated (less when the target was reached)
    samples_applied: int
    samples_per_s: float
    rounds_decoded: int
    rounds_applied: int
    rounds_replanned: int
    slots_assigned: int
    slots_measured: int  # assigned after the warm-up
    slots_cancelled: int
    wasted_fraction: float  # worker compute not in an applied gradient, over all of it (less
    # the results still waiting in open rounds at the end)
    mean_staleness: float
    staleness: dict[int, int]  # tau -> rounds applied
    coordinator_load: float  # busy fraction of the coordinator
    coordinator_by: dict  # its busy fraction by cause (results, models out, sums and steps, ...)
    time_to_target_s: Optional[float]
    scheduler_us_per_slot: float  # time inside scheduler calls per slot assigned (CPU share)
    decision_us_per_slot: float  # the same without ticks: result, ready, applied, join, leave
    tick_us: float  # time per tick (liveness, deadlines, speculation)
    heartbeat_us: float  # time inside scheduler.seen per heartbeat delivered (CPU share)
    wall_s: float
    series: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # the last evaluation's
    evaluations: int = 0  # evaluations answered (by the workers' evaluation slots, or here)
    evaluations_here: int = 0  # of which on the coordinator (confirming a target, or all of them)
    eval_on: str = WORKERS  # where they ran
    eval_slots: int = 0  # evaluation slots handed out
    eval_compute_fraction: float = 0.0  # workers' compute on evaluation slots, over all of it
    stopped: Optional[str] = None  # why the run ended early: "target", "bad target", "samples"
    codes: dict = field(default_factory=dict)
    downloaded: dict = field(default_factory=dict)  # sharded data: worker -> bytes of shards
    data_bytes: int = 0  # sharded data: the training set's bytes

    @property
    def download_ratio(self) -> Optional[float]:
        """The most any worker downloaded over its share of the data (data / workers)."""
        if not self.downloaded or not self.data_bytes:
            return None
        return max(self.downloaded.values()) / (self.data_bytes / len(self.downloaded))

    def summary(self) -> dict:
        out = {"samples_per_s": round(self.samples_per_s, 3),
               "wasted_fraction": round(self.wasted_fraction, 4),
               "mean_staleness": round(self.mean_staleness, 3)}
        if self.downloaded:
            out["download_ratio"] = round(self.download_ratio, 3)
            out["downloaded_mb"] = round(sum(self.downloaded.values()) / 2**20, 1)
        return out

    @classmethod
    def of(cls, sim, duration: float, wall: float) -> "ModeResult":
        """The figures of a finished `Simulation` that ran `duration` virtual seconds."""
        applied = sum(sim.staleness.values())
        # Results waiting in rounds still open at the end are neither used nor wasted yet.
        total = sim.compute_total - sum(sim.used_compute.values())
        stats = sim.scheduler.stats
        return cls(
            mode=sim.mode, duration_s=duration, samples_applied=sim.samples_applied,
            samples_per_s=sim.samples_applied / duration if duration > 0 else 0.0,
            rounds_decoded=sim.rounds_decoded, rounds_applied=sim.rounds_applied,
            rounds_replanned=sim.rounds_replanned, slots_assigned=sim.slots_assigned,
            slots_measured=sim.slots_measured,
            slots_cancelled=sim.slots_cancelled,
            wasted_fraction=max(0.0, (total - sim.compute_useful) / total) if total > 0 else 0.0,
            mean_staleness=(sum(t * n for t, n in sim.staleness.items()) / applied
                            if applied else 0.0),
            staleness=dict(sorted(sim.staleness.items())),
            coordinator_load=sim.coord_busy / duration if duration > 0 else 0.0,
            coordinator_by={k: v / duration for k, v in sim.coord_by.items()} if duration > 0
            else {},
            time_to_target_s=sim.time_to_target,
            scheduler_us_per_slot=(1e6 * (sim.sched_s + sim.tick_s) * sim.cpu_share
                                   / max(1, sim.slots_measured)),
            decision_us_per_slot=1e6 * sim.sched_s * sim.cpu_share / max(1, sim.slots_measured),
            tick_us=1e6 * sim.tick_s * sim.cpu_share / max(1, sim.ticks),
            heartbeat_us=1e6 * sim.beat_s * sim.cpu_share / max(1, sim.beats), wall_s=wall,
            series=sim.series, metrics=sim.metrics, evaluations=sim.evaluations,
            evaluations_here=sim.evaluations_here,
            eval_on=sim.run_core.where, eval_slots=sim.eval_slots,
            eval_compute_fraction=(sim.eval_compute / (sim.eval_compute + sim.compute_total)
                                   if sim.eval_compute else 0.0), stopped=sim.stopped,
            codes={k: stats["rounds_" + k] for k in ("none", "replicate", "cyclic")
                   if stats["rounds_" + k]},
            downloaded=({w.spec.id: w.downloaded for w in sim.workers.values()}
                        if sim.data.sharded else {}),
            data_bytes=sim.config.shards * sim.config.shard_bytes)
