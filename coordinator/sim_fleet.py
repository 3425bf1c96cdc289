"""The simulator's fleet (simulator.py): who the workers are, when they are there, and the data
they read. Worker specs (seconds per sample, credits, link, fault injection, jitter), fleets
drawn from a distribution, a preset mix or a CSV; availability sessions from a churn model or a
trace; a simulated worker's state (its process, its link, its cache of shards); the training set,
local or in shards that workers fetch. Pure: no clock, no torch.
"""

from __future__ import annotations

import csv
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..common.errors import ConfigError
from ..common.permutation import ShardOrder, part_indices


@dataclass
class WorkerSpec:
    id: str
    s_per_sample: float  # seconds of compute per sample, unloaded
    credits: int = 2
    latency_s: float = 0.02  # one way
    bandwidth: float = 12.5e6  # bytes/s each way (100 Mbit/s)
    slowdown: float = 1.0  # every task takes this many times as long (the engine's --slowdown)
    stall_p: float = 0.0  # with this probability per task ...
    stall_s: float = 0.0  # ... it stalls this long (the engine's --stall)
    jitter: float = 0.0  # sigma of a lognormal factor on each task's time
    sessions: Optional[list[tuple[float, float]]] = None  # (start, end); None: always on


# Classes for `mixed_fleet`: (name, share of the fleet, median seconds per sample, sigma).
# Relative speeds for a small convolutional net: a laptop's few cores, a desktop's many, a GPU.
FLEET_MIX = (("cpu-small", 0.6, 4e-3, 0.5), ("cpu-fast", 0.3, 1e-3, 0.4), ("gpu", 0.1, 1e-4, 0.3))


def lognormal_fleet(n: int, median_s: float, sigma: float, rng: np.random.Generator,
                    **spec) -> list[WorkerSpec]:
    speeds = median_s * np.exp(sigma * rng.standard_normal(n))
    return [WorkerSpec(f"w{i}", float(s), **spec) for i, s in enumerate(speeds)]


def mixed_fleet(n: int, rng: np.random.Generator, mix=FLEET_MIX, **spec) -> list[WorkerSpec]:
    shares = np.array([m[1] for m in mix], dtype=float)
    kinds = rng.choice(len(mix), size=n, p=shares / shares.sum())
    out = []
    for i, kind in enumerate(kinds):
        _, _, median, sigma = mix[kind]
        out.append(WorkerSpec(f"{mix[kind][0]}-{i}",
                              float(median * math.exp(sigma * rng.standard_normal())), **spec))
    return out


_CSV_FIELDS = {"s_per_sample": float, "credits": int, "latency_s": float, "bandwidth": float,
               "slowdown": float, "stall_p": float, "stall_s": float, "jitter": float}


def fleet_from_csv(path: str, **defaults) -> list[WorkerSpec]:
    """Rows `id,s_per_sample[,credits,latency_s,bandwidth,slowdown,stall_p,stall_s,jitter]`
    (a header row names the columns; an absent or empty one takes `defaults`, else
    WorkerSpec's)."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as exc:
        raise ConfigError(f"cannot read the fleet file {path}: {exc.strerror}") from None
    out = []
    for line, row in enumerate(rows, start=2):
        if not row.get("id") or not row.get("s_per_sample"):
            raise ConfigError(f"{path}:{line}: each row needs an id and s_per_sample")
        values = dict(defaults)
        for name, kind in _CSV_FIELDS.items():
            text = (row.get(name) or "").strip()
            if text:
                try:
                    values[name] = kind(text)
                except ValueError:
                    raise ConfigError(f"{path}:{line}: {name} {text!r} is not a number") from None
        if not values["s_per_sample"] > 0 or values.get("credits", 1) < 1:
            raise ConfigError(f"{path}:{line}: s_per_sample must be positive, credits >= 1")
        out.append(WorkerSpec(row["id"].strip(), **values))
    if not out:
        raise ConfigError(f"the fleet file {path} has no workers")
    return out


def sessions_from_trace(path: str) -> dict[str, list[tuple[float, float]]]:
    """Rows `worker,start,end` (seconds; an empty end: until the simulation ends)."""
    out: dict[str, list[tuple[float, float]]] = {}
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as exc:
        raise ConfigError(f"cannot read the trace file {path}: {exc.strerror}") from None
    for line, row in enumerate(rows, start=2):
        try:
            start = float(row["start"])
            end = float(row["end"]) if (row.get("end") or "").strip() else math.inf
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}:{line}: expected worker,start,end numbers") from None
        if not end > start >= 0:
            raise ConfigError(f"{path}:{line}: a session must end after it starts (start >= 0)")
        out.setdefault(str(row.get("worker", "")).strip(), []).append((start, end))
    return {w: sorted(s) for w, s in out.items()}


@dataclass(frozen=True)
class Churn:
    """Exponential on and off sessions (means in seconds); `diurnal` in [0, 1) swings the mean
    off time over a day (longer off at night-time of the cycle), `period_s` long."""

    mean_on_s: float
    mean_off_s: float
    diurnal: float = 0.0
    period_s: float = 86400.0

    def sessions(self, duration: float, rng: np.random.Generator) -> list[tuple[float, float]]:
        out = []
        t = 0.0
        on = rng.random() < self.mean_on_s / (self.mean_on_s + self.mean_off_s)
        while t < duration:
            if on:
                length = rng.exponential(self.mean_on_s)
                out.append((t, t + length))
            else:
                swing = 1.0 + self.diurnal * math.cos(2 * math.pi * t / self.period_s)
                length = rng.exponential(self.mean_off_s * swing)
            t += length
            on = not on
        return out


def parse_churn(text: str) -> Optional[Churn]:
    """`none`, `exp:ON:OFF` or `diurnal:ON:OFF:SWING` (seconds, seconds, 0..1)."""
    raw = text.strip().lower()
    if raw == "none":
        return None
    kind, _, rest = raw.partition(":")
    try:
        numbers = [float(x) for x in rest.split(":")] if rest else []
    except ValueError:
        numbers = None
    if kind == "exp" and numbers and len(numbers) == 2 and min(numbers) > 0:
        return Churn(numbers[0], numbers[1])
    if (kind == "diurnal" and numbers and len(numbers) == 3 and min(numbers[:2]) > 0
            and 0 <= numbers[2] < 1):
        return Churn(numbers[0], numbers[1], numbers[2])
    raise ConfigError(f"churn {text!r}: expected none, exp:ON_S:OFF_S or diurnal:ON_S:OFF_S:SWING "
                      "(e.g. exp:1800:600)")


class SimWorker:
    """A simulated worker's state: its availability sessions, its process (the daemon's own
    session, sim_worker.py) and connection, the slot it computes, its link and its cache of
    shards."""

    __slots__ = ("spec", "online", "available", "process", "conn", "current", "runs", "beat_at",
                 "beats", "rng", "sessions", "shards", "link_free", "downloaded")

    def __init__(self, spec: WorkerSpec, sessions, rng):
        self.spec = spec
        self.online = False
        self.available = 0  # the availability session: ends only when the machine goes away
        self.process = None  # its worker.session.Session while a process runs
        self.conn = 0  # its connection: messages of an older one reach nobody
        self.current = None  # (slot, its Assign, when it started, its run) while computing
        self.runs = 0  # computations started, each one's number
        self.beat_at = math.inf  # when the session's next tick is queued
        self.beats = 0  # heartbeats the session said since one was delivered
        self.rng = rng
        self.sessions = sessions
        # sharded data: shard -> when it is (or was) whole in the cache, least recently used first
        self.shards: OrderedDict[int, float] = OrderedDict()
        self.link_free = 0.0  # when its link finishes the downloads queued on it
        self.downloaded = 0  # bytes of shards fetched

    def held(self, now: float) -> list[int]:
        """The shards whole in its cache by `now` (what its heartbeats tell)."""
        return [k for k, when in self.shards.items() if when <= now]

    def fetch(self, shards, now: float, shard_bytes: int, cap: Optional[int]) -> float:
        """Queue on the link the shards it lacks, one download after another; returns when all
        of `shards` are whole in its cache (least recently used out beyond `cap`)."""
        ready = now
        for shard in shards:
            when = self.shards.get(shard)
            if when is None:
                self.link_free = max(self.link_free, now) + shard_bytes / self.spec.bandwidth
                when = self.link_free
                self.downloaded += shard_bytes
                self.shards[shard] = when
                while cap is not None and len(self.shards) > cap:
                    self.shards.popitem(last=False)
            self.shards.move_to_end(shard)
            ready = max(ready, when)
        return ready


class SimData:
    """The training set the fleet reads: on every worker already, or (`shards` > 0) cut into
    equal shards that workers fetch; its epoch order (shard-aware with `locality`, else a full
    shuffle); the shards a slot's parts read."""

    def __init__(self, samples: int, shards: int, seed: int, locality: bool, window: int):
        self.samples = samples
        self.shard_of: Optional[np.ndarray] = None  # sample -> its shard (sharded data)
        self.order = seed  # a full shuffle, or the shard-aware order
        if not shards:
            return
        if not 1 <= shards <= samples:
            raise ConfigError(f"--shards must be from 1 to the {samples} training samples")
        if window < 1:
            raise ConfigError("--shuffle-window must be at least 1")
        bounds = np.linspace(0, samples, shards + 1).round().astype(np.int64)
        per_shard = tuple(int(x) for x in np.diff(bounds))  # nearly equal
        self.shard_of = np.repeat(np.arange(shards), per_shard)
        if locality:
            self.order = ShardOrder(seed, per_shard, window)

    @property
    def sharded(self) -> bool:
        return self.shard_of is not None

    @property
    def shard_aware(self) -> bool:
        return isinstance(self.order, ShardOrder)

    def read(self, parts) -> list[int]:
        """The shards the samples of `parts` ((epoch, offset, count) each) lie in."""
        shards: set[int] = set()
        for epoch, offset, count in parts:
            indices = part_indices(self.order, self.samples, epoch, offset, count)
            shards.update(np.unique(self.shard_of[indices]).tolist())
        return sorted(shards)
