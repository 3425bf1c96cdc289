"""Hostile volunteers on a real fleet: what each attack costs the honest workers' run (issue 27).

A real coordinator (digits to a test accuracy of 0.9, CURVE keys, --enrolled, a ledger,
evaluations on workers and settlements on workers) and 3 honest worker processes on loopback, run
once per scenario with one hostile behaviour added, then once with all of them at once:

    clean                no attacker
    fake_eval            a worker answers its evaluation ranges with made-up perfect sums
    eval_missing_metric  ... with sums that lack the target's metric
    zero_gradients       a worker sends zero gradients (--poison scale:0)
    scaled_gradients     ... gradients x1e6
    tiny_gradients       ... gradients x1e-6
    two_keys_collude     two workers enrolled by two invitations send the same sign-flipped
                         gradients (--redundancy replicate:2 --verify-replicas)
    compute_s            a worker's honest results claim an hour of compute each
    name_theft           another key says hello under an honest worker's name, once it trains
    ready_flood          one key under 16 names, each asking for 1024 slots, never computing
    fetch_flood          one key under 4 names asking 200 chunks a second of a blob not served
    unheld_results       one key under 2 names sending 50 results a second (honest size) for
                         slots never dealt to it
    stranger             100 idle TCP connections to both endpoints, forged enrolments (no token)
    dropout_job          a job with nn.Dropout under verified replicas, honest workers only
    all                  every hostile behaviour above at once (verified replicas)

The hostile peers are tests/integration/hostile_peers.py (shared with the integration tests):
real workers with --poison, a real worker whose messages are rewritten (`lie`), and raw ZeroMQ
clients. The raw clients run at nice 19 (an attacker's CPU is its own: on this 2-core machine the
honest workers and the coordinator should not pay for building its floods); every worker
process, honest or hostile, at normal priority.

Per scenario: `reached` (the coordinator stopped at its target and this benchmark's own
evaluation of the final checkpoint on the held-out set meets it), `accuracy` (that evaluation),
`honest_banned` (bans.json entries of honest keys: must be 0), `honest_offences` (offences
counted against honest names), `suspected` (suspicions of the run; every one honest in
dropout_job), `hostile_banned` (hostile keys in bans.json), `samples_lost` (from the ledger: the
samples of every finished epoch the final model never saw and the final checkpoint does not
replan, plus any difference between the final metrics' sample count and the ledger lineage's),
`samples_in_flight` (those of a finished epoch in a round still open at the stop: the checkpoint
replans them on a resume), `duplicates`, and `throughput` (samples
applied per second, first to last step, in the ledger) over its baseline's: the clean run with
the same flags (`clean` or, for verified replicas, `clean_verify`, run when needed). Acceptance:
reached, honest_banned == 0, samples_lost == 0, throughput ratio >= 0.7 (and, for dropout_job,
suspected == 0). Exit status 1 when a scenario fails it. With --json the last line is
{"scenarios": {NAME: {...}}, "ok": bool}.

    PYTHONPATH=. python3 benchmarks/hostile.py [--scenarios clean,fake_eval] [--repeats 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from harness import Run, read_metrics, stopped_on_interrupt  # noqa: E402

HONEST = ("w1", "w2", "w3")
TARGET = 0.9
HIDDEN = 4096
# A small step, so that the run lasts long enough (~30 s here) for every attack to land.
LR = 2e-6
COORDINATOR_ARGS = ("--threads", "1", "--heartbeat", "0.5", "--log-level", "info",
                    "--eval-on", "workers", "--settle-on", "workers",
                    "--min-workers", str(len(HONEST)), "--checkpoint-every", "5",
                    "--target", f"accuracy={TARGET}", "--epochs", "1000")
VERIFY = ("--redundancy", "replicate:2", "--verify-replicas")
# every worker, honest or not, at normal priority: a worker at nice 19 on these 2 busy cores
# gets the CPU only in gaps, a straggler of its own making that sync rounds would wait for
WORKER_ARGS = ("--threads", "1", "--device", "cpu", "--no-idle-policy", "--no-low-priority",
               "--connect-timeout", "60", "--log-level", "info")
PEERS = "tests.integration.hostile_peers"
ATTACKS = ("fake_eval", "eval_missing_metric", "zero_gradients", "scaled_gradients",
           "tiny_gradients", "two_keys_collude", "compute_s", "name_theft", "ready_flood",
           "fetch_flood", "unheld_results", "stranger")
POISON = {"zero_gradients": "scale:0", "scaled_gradients": "scale:1e6",
          "tiny_gradients": "scale:1e-6"}


@dataclass(frozen=True)
class Scenario:
    attacks: tuple[str, ...]
    verify: bool = False
    job_args: tuple[str, ...] = ()
    baseline: str = "clean"


SCENARIOS: dict[str, Scenario] = {
    "clean": Scenario(()),
    **{a: Scenario((a,)) for a in ATTACKS if a != "two_keys_collude"},
    "two_keys_collude": Scenario(("two_keys_collude",), verify=True, baseline="clean_verify"),
    "dropout_job": Scenario((), verify=True, job_args=("dropout=0.5",), baseline="clean_verify"),
    "all": Scenario(ATTACKS, verify=True, baseline="clean_verify"),
}
BASELINES = {"clean": SCENARIOS["clean"], "clean_verify": Scenario((), verify=True)}
# the order of SCENARIOS keeps the tiny_gradients line where the docstring has it
ORDER = ("clean", "fake_eval", "eval_missing_metric", "zero_gradients", "scaled_gradients",
         "tiny_gradients", "two_keys_collude", "compute_s", "name_theft", "ready_flood",
         "fetch_flood", "unheld_results", "stranger", "dropout_job", "all")


def job_args(scenario: Scenario) -> dict:
    from idlegrad.common.job import parse_job_args

    return parse_job_args([f"hidden={HIDDEN}", f"lr={LR}", *scenario.job_args])


def built(scenario: Scenario):
    from idlegrad.common.job import build, load_job

    job = load_job("digits", job_args(scenario))
    return job, build(job)


@dataclass
class Fleet:
    """One scenario's run: its keys, its processes (benchmarks/harness.py's Run) and its
    status endpoint."""

    run: Run
    address: str
    numel: int
    keys: Path = field(init=False)
    hostile_keys: dict = field(default_factory=dict)  # key name -> public key file
    honest_keys: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)  # name -> Popen

    def __post_init__(self):
        from idlegrad.common import security

        self.keys = self.run.dir / "keys"
        for d in ("keys", "allow", "monitors", "enrolled"):
            (self.run.dir / d).mkdir(exist_ok=True)
        security.generate("coord", str(self.keys))
        security.generate("monitor", str(self.keys))
        (self.run.dir / "monitors" / "monitor.key").write_bytes(
            (self.keys / "monitor.key").read_bytes())
        for name in HONEST:
            self.honest_keys[name] = self.listed(name)

    def listed(self, name: str) -> Path:
        from idlegrad.common import security

        security.generate(name, str(self.keys))
        public = self.run.dir / "allow" / f"{name}.key"
        public.write_bytes((self.keys / f"{name}.key").read_bytes())
        return public

    def key_flags(self, name: str) -> list:
        return ["--coordinator-key", self.keys / "coord.key",
                "--secret-key", self.keys / f"{name}.key_secret"]

    def worker(self, name: str, *extra, key: Optional[str] = None):
        args = ["worker", "--coordinator", self.address, "--id", name, *WORKER_ARGS,
                *self.key_flags(key or name), *extra]
        self.procs[name] = self.run.spawn_idlegrad(name, args)

    def hostile_worker(self, role: str, *extra, name: Optional[str] = None) -> None:
        key = f"evil-{role}"
        self.hostile_keys[key] = self.listed(key)
        self.worker(name or key, *extra, key=key)

    def liar(self, lie: str) -> None:
        key = f"evil-{lie}"
        self.hostile_keys[key] = self.listed(key)
        self.procs[key] = self.run.spawn_python(key, [
            "-m", PEERS, "lie", lie, "--", "worker", "--coordinator", self.address, "--id", key,
            *WORKER_ARGS, *self.key_flags(key)])

    def peer(self, name: str, args: list, key: Optional[str] = None) -> None:
        flags = ["--coordinator", self.address, "--coordinator-key", self.keys / "coord.key",
                 "--nice", "19"]
        if key is not None:
            self.hostile_keys[key] = self.listed(key)
            flags += ["--secret-key", self.keys / f"{key}.key_secret"]
        self.procs[name] = self.run.spawn_python(name, ["-m", PEERS, *args, *flags])

    def invited(self, name: str) -> Path:
        """A worker.toml enrolled by an invitation of its own (`idlegrad worker join`)."""
        config = self.run.dir / name / "worker.toml"
        token = self.tokens.pop()
        out = subprocess.run([sys.executable, "-m", "idlegrad.cli", "worker", "join", token,
                              "--config", str(config), "--timeout", "30"], env=self.run.env,
                             capture_output=True, text=True, timeout=90)
        if out.returncode != 0:
            raise RuntimeError(f"{name}: join failed: {out.stderr[-500:]}")
        self.hostile_keys[name] = config.parent / "worker.key"
        return config

    tokens: list = field(default_factory=list)


def mint_invitations(fleet: Fleet, n: int) -> None:
    from idlegrad.common import security
    from idlegrad.coordinator import enrolment

    store = enrolment.Store(str(fleet.run.dir / "enrolled")).prepare()
    server_key = security.load_keypair(str(fleet.keys / "coord.key_secret"))[0]
    for i in range(n):
        _, token = enrolment.issue(store, fleet.address, server_key, 1, 3600, f"colluder{i}",
                                   time.time())
        fleet.tokens.append(token)


def start_attacks(fleet: Fleet, attacks: tuple[str, ...]) -> list[Callable[[dict], bool]]:
    """Start every attack that starts at once; the ones that wait for a moment of the run are
    returned as callables, each handed every status snapshot until it says it started."""
    later: list[Callable[[dict], bool]] = []
    for attack in attacks:
        if attack in POISON:
            fleet.hostile_worker(attack, "--poison", POISON[attack])
        elif attack in ("fake_eval", "eval_missing_metric", "compute_s"):
            fleet.liar(attack)
        elif attack == "ready_flood":
            fleet.peer(attack, ["flood", "ready", "--names", "16", "--name-prefix", "ready"],
                       key="evil-ready")
        elif attack == "fetch_flood":
            fleet.peer(attack, ["flood", "fetch", "--names", "4", "--rate", "200",
                                "--name-prefix", "fetch"], key="evil-fetch")
        elif attack == "unheld_results":
            fleet.peer(attack, ["flood", "unheld", "--names", "2", "--rate", "50",
                                "--numel", str(fleet.numel), "--name-prefix", "unheld"],
                       key="evil-unheld")
        elif attack == "stranger":
            fleet.peer(attack, ["stranger", "--idle", "100", "--forgers", "8"])
        elif attack == "two_keys_collude":
            def collude(snap: dict, fleet=fleet) -> bool:
                if snap.get("version", 0) < 1:
                    return False
                for i in range(2):
                    config = fleet.invited(f"colluder{i}")
                    fleet.procs[f"colluder{i}"] = fleet.run.spawn_idlegrad(f"colluder{i}", [
                        "worker", "--config", config, *WORKER_ARGS, "--poison", "flip"])
                return True
            later.append(collude)
        elif attack == "name_theft":
            def steal(snap: dict, fleet=fleet) -> bool:
                if "w1" not in {w["id"] for w in snap.get("workers", [])}:
                    return False
                fleet.hostile_worker("thief", name="w1")  # w1's name, its own key
                return True
            later.append(steal)
        else:
            raise ValueError(attack)
    return later


def public_text(path: Path) -> str:
    from idlegrad.common.security import load_public

    return load_public(str(path)).decode()


def measure(name: str, scenario: Scenario, directory: Path, timeout: float) -> dict:
    from idlegrad.common.job import evaluate
    from idlegrad.common.security import client_keys
    from idlegrad.coordinator import checkpoint
    from idlegrad.coordinator.ledger import audit, read
    from tests.integration.harness import Status
    from tests.integration.hostile_peers import two_free_ports

    job, b = built(scenario)
    n_train = len(b.train)
    address = f"tcp://127.0.0.1:{two_free_ports()}"
    ckpt, ledger = directory / "ckpt", directory / "ledger.jsonl"
    started = time.monotonic()
    status = None
    with Run(directory) as run:
        run.env["PYTHONPATH"] = os.pathsep.join(
            [ROOT, *filter(None, [run.env.get("PYTHONPATH")])])
        fleet = Fleet(run, address, b.model.numel)
        if "two_keys_collude" in scenario.attacks:
            mint_invitations(fleet, 2)
        args = ["coordinator", "--job", "digits"]
        for arg in job_args_cli(scenario):
            args += ["--job-arg", arg]
        args += ["--bind", address, *COORDINATOR_ARGS, *(VERIFY if scenario.verify else ()),
                 "--checkpoint-dir", ckpt, "--ledger", ledger,
                 "--secret-key", fleet.keys / "coord.key_secret",
                 "--allow-keys", run.dir / "allow", "--monitor-keys", run.dir / "monitors",
                 "--enrolled", run.dir / "enrolled"]
        coordinator = run.spawn_idlegrad("coordinator", args)
        for w in HONEST:
            fleet.worker(w)
        later = start_attacks(fleet, scenario.attacks)
        status = Status(address, keys=client_keys(str(fleet.keys / "coord.key"),
                                                  str(fleet.keys / "monitor.key_secret")))
        end = started + timeout
        timed_out = False
        try:
            while coordinator.poll() is None:
                if time.monotonic() > end:
                    timed_out = True
                    break
                snap = status.fetch(timeout=0.5)
                if snap is not None:
                    later = [start for start in later if not start(snap)]
                time.sleep(0.2)
        finally:
            status.close()
        exit_code = coordinator.poll()
    wall = time.monotonic() - started
    metrics = [r for r in read_metrics(ckpt / "metrics.jsonl") if r.get("final")]
    final = metrics[-1] if metrics else {}
    state = checkpoint.load(str(ckpt))
    accuracy = None
    if state is not None:
        b.model.load(state["params"])
        if state.get("buffers") is not None:
            b.model.load_buffer_state(state["buffers"])
        accuracy = float(evaluate(job, b.model.module, b.test)["accuracy"])
    records = read(str(ledger)) if ledger.exists() else []
    final_samples = int(final.get("samples", state["samples"] if state else 0))
    account = audit(records, n_train, final_samples // n_train)
    # rounds open when the run stopped are in the checkpoint, replanned on a resume: in flight,
    # not lost (an epoch counted finished may still have one open)
    replan = ((state or {}).get("sampler") or {}).get("replan") or []
    in_flight = sum(count for parts in replan for epoch, _, count in parts
                    if epoch < final_samples // n_train)
    applied_t = [r["t"] for r in records if r.get("event") == "applied" and "t" in r]
    span = (max(applied_t) - min(applied_t)) if len(applied_t) > 1 else math.nan
    honest_pub = {public_text(p) for p in fleet.honest_keys.values()}
    hostile_pub = {public_text(p): k for k, p in fleet.hostile_keys.items() if p.exists()}
    last = (status.last if status is not None else None) or {}
    trust = last.get("trust", {})
    offenders = trust.get("offenders", {})
    # banned identities (keys, here): the trust policy's, and the operator's (bans.json)
    banned = set(trust.get("banned", [])) | {i for i, o in offenders.items() if o.get("banned")}
    bans_path = run.dir / "enrolled" / "bans.json"
    if bans_path.exists():
        banned |= set(json.loads(bans_path.read_text()).get("bans", {}))
    credits = (last.get("credits") or {}).get("workers", {})
    honest_compute = [credits[w]["compute_s"] for w in HONEST if w in credits]
    liar_compute = credits.get("evil-compute_s", {}).get("compute_s")
    tracebacks = sum(p.read_text(errors="replace").count("Traceback")
                     for p in run.dir.glob("*.log"))
    return {
        "scenario": name, "exit": exit_code, "timed_out": timed_out, "wall_s": wall,
        "reason": final.get("reason"), "accuracy": accuracy,
        "coordinator_accuracy": (final.get("metrics") or {}).get("accuracy"),
        "reached": bool(final.get("reason") == "target" and accuracy is not None
                        and accuracy >= TARGET and not timed_out),
        "honest_banned": len({i for i in banned if i in honest_pub or i in HONEST}),
        "honest_offences": sum(o.get("offences", 0) for i, o in offenders.items()
                               if i in HONEST or i in honest_pub),
        "suspected": trust.get("suspected"),
        "hostile_banned": sorted(hostile_pub.get(i, i) for i in banned
                                 if i not in honest_pub and i not in HONEST),
        "workers_banned": (final.get("counters") or {}).get("workers_banned", 0),
        "trust": {k: trust.get(k) for k in ("accepted", "refused", "suspected", "banned_count")},
        "hostile_keys": len(fleet.hostile_keys),
        "samples": final_samples, "ledger_samples": account.samples,
        "samples_lost": max(0, account.lost - in_flight) + abs(final_samples - account.samples),
        "samples_in_flight": in_flight,
        "duplicates": account.duplicates,
        "samples_per_s": account.samples / span if span and span > 0 else None,
        "span_s": span,
        "liar_compute_s": liar_compute,
        "honest_compute_s": statistics.median(honest_compute) if honest_compute else None,
        "counters": {k: v for k, v in (final.get("counters") or {}).items()
                     if any(s in k for s in ("refused", "dropped", "unheld", "names", "budget",
                                             "rejected", "identity", "fetch", "enrol",
                                             "unexpected", "eval"))},
        "tracebacks": tracebacks,
    }


def job_args_cli(scenario: Scenario) -> list[str]:
    return [f"hidden={HIDDEN}", f"lr={LR}", *scenario.job_args]


def accept(row: dict, name: str) -> list[str]:
    why = []
    if not row["reached"]:
        why.append("target not reached")
    if row["honest_banned"]:
        why.append(f"{row['honest_banned']} honest banned")
    if row["samples_lost"] or row["duplicates"]:
        why.append(f"{row['samples_lost']} samples lost, {row['duplicates']} duplicates")
    ratio = row.get("throughput_vs_clean")
    if ratio is not None and ratio < 0.7:
        why.append(f"throughput {ratio:.2f}x")
    if name == "dropout_job" and row["suspected"]:
        why.append(f"{row['suspected']} honest suspected")
    return why


def median_row(rows: list[dict]) -> dict:
    """The run of median throughput (the others' figures alongside in `runs`)."""
    ordered = sorted(rows, key=lambda r: r["samples_per_s"] or 0.0)
    row = dict(ordered[len(ordered) // 2])
    row["runs"] = len(rows)
    row["reached"] = all(r["reached"] for r in rows)
    row["honest_banned"] = max(r["honest_banned"] for r in rows)
    row["samples_lost"] = max(r["samples_lost"] for r in rows)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(ORDER),
                        help=f"comma-separated, of: {', '.join(ORDER)} (default: all of them)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per scenario; the median run's figures are shown")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    parser.add_argument("--keep", metavar="DIR", help="keep every run's logs here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    needed = {SCENARIOS[s].baseline for s in wanted if s != SCENARIOS[s].baseline}
    plan = [b for b in ("clean", "clean_verify") if b in needed or b in wanted]
    plan += [s for s in ORDER if s in wanted and s not in plan]
    base = Path(args.keep or tempfile.mkdtemp(prefix="idlegrad-hostile-"))
    rows: dict[str, list[dict]] = {}
    with stopped_on_interrupt():
        for i in range(args.repeats):
            for name in plan:
                scenario = SCENARIOS.get(name) or BASELINES[name]
                row = measure(name, scenario, base / f"{name}-{i}", args.timeout)
                rows.setdefault(name, []).append(row)
                print(f"  {name} run {i}: reached={row['reached']} acc={row['accuracy']} "
                      f"{row['samples_per_s'] or 0:.0f} samples/s in {row['wall_s']:.0f}s",
                      file=sys.stderr, flush=True)
    summary: dict[str, dict] = {}
    for name, runs in rows.items():
        summary[name] = median_row(runs)
    for name, row in summary.items():
        scenario = SCENARIOS.get(name) or BASELINES[name]
        base_row = summary.get(scenario.baseline)
        ratio = None
        if base_row and base_row["samples_per_s"] and row["samples_per_s"]:
            ratio = row["samples_per_s"] / base_row["samples_per_s"]
        row["baseline"] = scenario.baseline
        row["throughput_vs_clean"] = ratio
        row["failures"] = accept(row, name)
    ok = all(not summary[n]["failures"] for n in summary)
    header = (f"{'scenario':<20} {'reached':>7} {'acc':>6} {'hon.ban':>7} {'hon.off':>7} "
              f"{'susp':>5} {'host.ban':>8} {'lost':>5} {'samples/s':>9} {'vs clean':>8}  notes")
    print(header)
    for name, row in summary.items():
        ratio = row["throughput_vs_clean"]
        notes = ", ".join(row["failures"]) or "ok"
        if row.get("samples_in_flight"):
            notes += f"; {row['samples_in_flight']} samples in flight at the stop (replanned)"
        if row["liar_compute_s"] is not None:
            notes += (f"; liar credited {row['liar_compute_s']:.1f} s vs honest "
                      f"{row['honest_compute_s'] or 0:.1f} s")
        print(f"{name:<20} {str(row['reached']):>7} {row['accuracy'] or 0:>6.3f} "
              f"{row['honest_banned']:>7} {row['honest_offences']:>7} "
              f"{row['suspected'] if row['suspected'] is not None else '-':>5} "
              f"{len(row['hostile_banned']):>3}/{row['hostile_keys']:<4} "
              f"{row['samples_lost']:>5} {row['samples_per_s'] or 0:>9.0f} "
              f"{'-' if ratio is None else format(ratio, '.2f'):>8}  {notes}")
    print(f"(baseline of each ratio: its `baseline`; logs under {base})")
    if args.json:
        print(json.dumps({"scenarios": summary, "ok": ok}, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
