"""What one worker key may cost the coordinator: its budgets. Pure (no sockets, no clock: time
is an argument).

A key is one identity however many worker names it says hello under, so what a key can make the
coordinator do is bounded per key, not per name (issue 27: one key under many names opened
thousands of rounds, flooded the blob service, and sent results for slots it did not hold, each
decoded and normed before it was dropped):

- names: at most `names` worker names held by one key at once; a hello under one more is refused
  (code `names`);
- credits: the credits of all the names of a key together are at most `credits` (a `ready` that
  asks for more is granted what is left), so the slots a key holds, and the rounds its hunger
  opens, are bounded;
- results: a result for a slot its sender does not hold is dropped before any of its gradient
  frames is decoded, so a flood of them costs a dictionary lookup each; and at most
  `results_per_s` per key are read (a token bucket of `results_burst`). A result over that rate
  is not read either, but its slot is not lost: it goes back to the round for the next worker
  that asks (the server hands it back), or the round would wait for it until the slot's
  deadline, and under `--sync` its holder would take nothing else meanwhile;
- fetches: at most `fetches` chunk requests waiting per key (blobserve.py takes the keys in
  turn, so 256 names of one key are served as one).

Without keys a worker's identity is its name, and every budget is per name.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from ..common import protocol as proto
from ..common.errors import ConfigError
from .gate import Refusal


@dataclass(frozen=True)
class BudgetConfig:
    names: int = 16  # worker names one key may hold at once
    credits: int = 64  # credits (slots held at once) of all the names of one key together
    fetches: int = 32  # chunk requests waiting per key (blobserve.py)
    # Results per second per key, over a burst (0: no limit). A key can only answer the slots it
    # was dealt, so this bounds one that answers faster than anybody computes; it is well over
    # what an honest worker sends on a small model (digits: about 270 a second each, two
    # workers on this 2-core machine).
    results_per_s: float = 1000.0
    results_burst: float = 2000.0

    def __post_init__(self):
        if self.names < 1 or self.credits < 1 or self.fetches < 1:
            raise ConfigError(f"--key-names, --key-credits and --key-fetches must be at least 1, "
                              f"not {self.names}, {self.credits}, {self.fetches}")
        if self.results_per_s < 0 or self.results_burst < 1:
            raise ConfigError(f"--key-results-per-s must be at least 0 (0: no limit), not "
                              f"{self.results_per_s:g}")


class TokenBucket:
    """`rate` tokens a second, at most `burst` kept; each take spends one."""

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, now

    def level(self, now: float) -> float:
        return min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)

    def take(self, now: float) -> bool:
        self.tokens, self.at = self.level(now), max(self.at, now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


# What `KeyBudgets.result` says of a result
DECODE = "decode"  # worth decoding
UNHELD = "unheld"  # its sender does not hold the slot: dropped
OVER_RATE = "over_rate"  # its key is over its rate: not read, the slot goes back to the round

BUCKETS_KEPT = 4096  # over this many identities, the buckets that are full again are let go


class KeyBudgets:
    """The budgets of every key. `identity(name, key=None)`: who holds a worker name now, or
    would under `key` (the key's identity, else the name: gate.Gate.identity); `holds(name, slot)`: whether that worker holds
    the slot now (scheduler.Scheduler.holds); `capacity(name)`: the credits it was granted (0
    when it is gone)."""

    def __init__(self, config: BudgetConfig, identity: Callable[..., str],
                 holds: Callable[[str, int], bool], capacity: Callable[[str], int],
                 counters: Optional[Counter] = None):
        self.config = config
        self.identity = identity
        self.holds = holds
        self.capacity = capacity
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self._names: dict[str, dict[str, None]] = {}  # identity -> the names it said hello as
        self._buckets: dict[str, TokenBucket] = {}  # identity -> its results' bucket

    @classmethod
    def serving(cls, config: BudgetConfig, gate, core) -> "KeyBudgets":
        """The budgets of a coordinator: its gate says who holds a name, its round core's
        scheduler who holds a slot and with how many credits; counted in the core's counters."""
        scheduler = core.scheduler
        return cls(config, gate.identity, scheduler.holds, scheduler.capacity, core.counters)

    def names_of(self, identity: str) -> list[str]:
        """The names `identity` holds now (those it lost meanwhile are let go here)."""
        names = self._names.get(identity)
        if names is None:
            return []
        for name in [n for n in names if self.identity(n) != identity]:
            del names[name]
        if not names:
            del self._names[identity]
        return list(names)

    def hello(self, identity: str, name: str) -> Optional[Refusal]:
        """A hello as `name` under `identity`: None, and the name is counted; or the refusal."""
        held = self.names_of(identity)
        if name not in held and len(held) >= self.config.names:
            return Refusal("hello_names", "names",
                           f"this key already works here under {len(held)} names, its budget "
                           f"(the coordinator's --key-names): reuse one of them")
        self._names.setdefault(identity, {})[name] = None
        return None

    def credits(self, identity: str, name: str, asked: int) -> int:
        """The credits a `ready` of `name` is granted: what it asks, within what the key's other
        names leave of its budget."""
        others = sum(self.capacity(n) for n in self.names_of(identity) if n != name)
        granted = max(0, min(asked, self.config.credits - others))
        if granted < asked:
            self.counters["credits_over_budget"] += asked - granted
        return granted

    def result(self, identity: str, name: str, slot: int, now: float) -> str:
        """What to do with a result of `name` for `slot`, asked before any gradient frame is
        read: `DECODE` when its sender holds the slot and its key is within its rate, else
        `UNHELD` or `OVER_RATE`."""
        if not self.holds(name, slot):
            self.counters["results_unheld"] += 1
            return UNHELD
        if self.config.results_per_s <= 0:
            return DECODE
        bucket = self._buckets.get(identity)
        if bucket is None:
            if len(self._buckets) >= BUCKETS_KEPT:
                self._forget_full(now)
            bucket = self._buckets[identity] = TokenBucket(
                self.config.results_per_s, self.config.results_burst, now)
        if not bucket.take(now):
            self.counters["results_over_budget"] += 1
            return OVER_RATE
        return DECODE

    def _forget_full(self, now: float) -> None:
        # a full bucket is what a new one would be: forgetting it changes nothing
        for identity in [i for i, b in self._buckets.items() if b.level(now) >= b.burst]:
            del self._buckets[identity]

    def admit(self, key: Optional[bytes], msg: proto.Message) -> Optional[Refusal]:
        """What the gate does not say (gate.Gate.admit): a hello over its key's names."""
        if isinstance(msg, proto.Hello) and key is not None:
            return self.hello(self.identity(msg.worker_id, key), msg.worker_id)
        return None
