"""The fleet simulator: small fleets whose answers are known, and its inputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from idlegrad.common.errors import ConfigError
from idlegrad.coordinator import simulator as sim

FREE = sim.CoordinatorCosts(per_message_s=0.0, bytes_per_s=math.inf)


def identical(n: int, s_per_sample: float = 0.01, **spec) -> list[sim.WorkerSpec]:
    spec = {"latency_s": 0.0, "bandwidth": math.inf, **spec}
    return [sim.WorkerSpec(f"w{i}", s_per_sample, **spec) for i in range(n)]


def config(**kw) -> sim.SimConfig:
    base = dict(duration_s=200.0, batch_size=400, partitions=4, costs=FREE, max_staleness=10 ** 6,
                train_samples=10 ** 6)
    base.update(kw)
    return sim.SimConfig(**base)


def test_identical_workers_without_churn_run_at_the_fleets_speed():
    # 4 workers at 0.01 s a sample: 400 samples/s between them, all of it applied
    r = sim.simulate(identical(4), config(), "none")
    assert r.samples_per_s == pytest.approx(400.0, rel=0.02)
    assert r.wasted_fraction == pytest.approx(0.0, abs=1e-9)
    assert r.rounds_replanned == 0 and r.slots_cancelled == 0
    assert r.samples_applied == 400 * r.rounds_applied


def test_throughput_follows_the_fleet_size():
    small = sim.simulate(identical(2), config(), "none").samples_per_s
    large = sim.simulate(identical(8), config(), "none").samples_per_s
    assert large / small == pytest.approx(4.0, rel=0.03)


def test_sync_slots_sized_to_their_workers_do_not_wait_for_the_slowest():
    # one worker 4x slower. Equal parts (400 samples over 4 workers, 100 each) would take the
    # slow worker's 4 s a round: 100 samples/s. Parts sized to the workers' measured speeds
    # (round_book.py `slot_shares`) finish together: the fleet's 3.25 workers' worth, 325
    # samples/s, less the first rounds (equal, before anything is measured)
    fleet = identical(4)
    fleet[3].slowdown = 4.0
    sync = sim.simulate(fleet, config(), "sync")
    assert 280.0 < sync.samples_per_s <= 325.0
    assert sync.mean_staleness == 0.0


def test_churn_removes_capacity():
    fleet = identical(4)
    for w in fleet:  # on half the time, in 20 s sessions
        w.sessions = [(t, t + 20.0) for t in range(0, 200, 40)]
    r = sim.simulate(fleet, config(task_timeout_s=5.0), "none")
    full = sim.simulate(identical(4), config(), "none")
    assert 0.3 * full.samples_per_s < r.samples_per_s < 0.55 * full.samples_per_s


def test_a_worker_that_vanishes_is_evicted_and_its_slots_go_to_the_others():
    fleet = identical(2)
    fleet[1].sessions = [(0.0, 50.0)]  # gone, silently, at 50 s
    s = sim.Simulation(fleet, config(), "none")
    computed = []
    done = s._done
    s._done = lambda w, *rest: (computed.append((w.spec.id, s.now)), done(w, *rest))
    s._handlers = lambda: {**sim.Simulation._handlers(s), sim._DONE: s._done}
    r = s.run()
    # tasks sent to it after it vanished (before the scheduler noticed) are never computed
    assert max(t for w, t in computed if w == "w1") <= 50.0
    assert s.scheduler.stats["workers_removed"] == 1
    assert set(s.scheduler.workers) == {"w0"}
    # 200/s for 50 s, then 100/s for 150 s (less the slots lost with it)
    assert r.samples_applied == pytest.approx(200 * 50 + 100 * 150, rel=0.05)
    assert r.wasted_fraction > 0


def test_a_worker_evicted_while_alive_rejoins_and_still_leaves_on_time():
    # a coordinator too slow to hear heartbeats in time evicts live workers; they handshake
    # again, and their machines still go away when their sessions end
    costs = sim.CoordinatorCosts(per_message_s=0.02, bytes_per_s=math.inf)
    fleet = identical(20, s_per_sample=0.0001)
    for w in fleet:
        w.sessions = [(0.0, 30.0)]
    s = sim.Simulation(fleet, config(costs=costs, duration_s=60.0, heartbeat_s=0.2), "none")
    s.run()
    assert s.scheduler.stats["workers_removed"] > 0
    assert s.online == 0 and not any(w.online for w in s.workers.values())


def test_each_simulated_worker_is_the_daemons_session_and_its_results_are_acknowledged():
    from idlegrad.worker.session import SERVING, Session

    s = sim.Simulation(identical(4), config(), "none")
    r = s.run()
    sessions = [w.process for w in s.workers.values()]
    assert all(isinstance(p, Session) and p.state == SERVING for p in sessions)
    # every result the rounds applied was sent by a session (100 samples a slot), and the
    # coordinator acknowledged them (on the next task, or alone): none are kept for resending
    assert sum(p.results_sent for p in sessions) >= r.samples_applied // 100 > 0
    assert all(len(p.unacked) <= 1 for p in sessions), [len(p.unacked) for p in sessions]


def test_an_evicted_session_is_told_hello_first_and_joins_again_at_once():
    # the coordinator forgets a live worker at 10 s: its next message (a result within the
    # second) is refused with hello_first, and its session says hello again on the same
    # connection, as the daemon's does; not 3 s later, when it would take the silence for an
    # outage
    s = sim.Simulation(identical(2), config(duration_s=20.0), "none")
    joins = []
    join, tick = s.core.join, s._tick
    s.core.join = lambda worker, *rest: (joins.append((worker, s.now)), join(worker, *rest))[1]

    def evicting_tick():
        if 10.0 <= s.now < 10.5:
            s._perform(s.core.leave("w0", "forgotten", s.now))
        tick()

    s._tick = evicting_tick
    s._handlers = lambda: {**sim.Simulation._handlers(s), sim._TICK: s._tick}
    s.run()
    again = [t for w, t in joins if w == "w0" and t > 0.0]
    assert len(again) == 1 and 10.0 <= again[0] <= 11.5, joins
    assert "w0" in s.scheduler.workers and s.workers["w0"].process.state == "serving"


def test_a_saturated_coordinator_is_the_bottleneck():
    # every message costs 0.05 s: at most 20 results a second, whatever the fleet could do
    costs = sim.CoordinatorCosts(per_message_s=0.05, bytes_per_s=math.inf)
    r = sim.simulate(identical(40, s_per_sample=0.001), config(costs=costs, duration_s=100.0),
                     "none")
    assert r.coordinator_load > 0.95
    assert r.samples_per_s <= 20 * 100 * 1.02  # 100 samples a slot


def test_replication_rides_out_a_staller():
    fleet = identical(4, jitter=0.0)
    fleet[0].stall_p, fleet[0].stall_s = 0.5, 20.0
    cfg = config(open_rounds=1, target_samples=20_000, duration_s=10_000.0)
    none = sim.simulate(fleet, cfg, "none")
    replicated = sim.simulate(fleet, cfg, "replicate:2")
    assert replicated.time_to_target_s < none.time_to_target_s
    # the second copies wait behind first copies in the workers' queues: most are cancelled
    # before they start, so replication wastes far less than half here
    assert 0 < replicated.wasted_fraction < 0.5


def test_same_seed_same_answer_and_modes_share_the_sessions():
    rng = np.random.default_rng(3)
    fleet = sim.lognormal_fleet(20, 0.01, 0.5, rng, jitter=0.2)
    churn = sim.Churn(30.0, 10.0)
    for w in fleet:
        w.sessions = churn.sessions(120.0, rng)
    cfg = config(duration_s=120.0)
    a = sim.compare(fleet, cfg, ["none", "cyclic:1"])
    b = sim.compare(fleet, cfg, ["none", "cyclic:1"])
    for mode in a:
        assert a[mode].samples_applied == b[mode].samples_applied
        assert a[mode].staleness == b[mode].staleness
    assert a["none"].slots_assigned != a["cyclic:1"].slots_assigned  # the modes did differ


def test_target_samples_stops_the_clock():
    r = sim.simulate(identical(4), config(target_samples=4000), "none")
    assert r.time_to_target_s == pytest.approx(10.0, rel=0.1)
    assert r.samples_applied >= 4000


def test_real_gradients_train_and_follow_the_staleness_rule():
    from idlegrad.coordinator.staleness import StalenessRule
    from idlegrad.coordinator.target import Target

    rule = StalenessRule("inverse", 32)
    gradients = sim.RealGradients("synthetic", {"params": 2000, "samples": 1024,
                                                "batch_size": 128, "lr": 0.05}, 0, rule)
    target = Target.parse("accuracy=0.5")
    r = sim.simulate(identical(4, s_per_sample=0.001), config(duration_s=60.0, eval_every_s=0.5),
                     "none", gradients, target)
    assert r.time_to_target_s is not None
    assert r.metrics["accuracy"] >= 0.5
    assert gradients.aggregator.version == r.rounds_applied


def test_evaluations_run_on_the_workers_evaluation_slots_through_the_run_core():
    # one slot of 800 test samples per evaluation (two batches of 400): 800 x 0.01 s / 3
    r = sim.simulate(identical(4), config(eval_every_s=5.0, test_samples=800), "none")
    assert r.eval_on == "workers" and r.evaluations_here == 0
    assert r.evaluations >= 10 and r.eval_slots >= r.evaluations
    eval_s = r.evaluations * 800 * 0.01 / 3
    assert r.eval_compute_fraction == pytest.approx(eval_s / (4 * 200.0), rel=0.1)
    assert r.wasted_fraction == pytest.approx(0.0, abs=1e-9)  # evaluation is not waste
    # the synthetic metric is the evaluated version, added up from the slots' sums
    points = [p for p in r.series if "metrics" in p]
    assert len(points) == r.evaluations
    assert all(p["metrics"] == {"version": p["version"]} for p in points)
    assert 0 < points[-1]["version"] <= r.rounds_applied
    assert r.stopped is None and r.duration_s == 200.0


def test_a_target_met_stops_the_run_once_confirmed_on_the_current_model():
    from idlegrad.coordinator.target import Target

    r = sim.simulate(identical(4), config(eval_every_s=1.0, test_samples=800), "none",
                     target=Target.parse("version>=20"))
    assert r.stopped == "target" and r.time_to_target_s == r.duration_s < 200.0
    # the evaluation that met it was of an older version: confirmed here, on the current one
    assert r.evaluations_here == 1 and r.metrics["version"] == r.rounds_applied >= 20
    bad = sim.simulate(identical(4), config(eval_every_s=1.0), "none",
                       target=Target.parse("accuracy>=0.9"))
    # the workers' answer names no accuracy: only the coordinator's own evaluation says so
    assert bad.stopped == "bad target" and bad.evaluations == 2 and bad.evaluations_here == 1
    assert bad.time_to_target_s is None


def test_churn_sessions_alternate_and_cover_about_their_share():
    churn = sim.Churn(300.0, 100.0)
    sessions = churn.sessions(200_000.0, np.random.default_rng(0))
    on = sum(min(e, 200_000.0) - s for s, e in sessions)
    assert on / 200_000.0 == pytest.approx(0.75, abs=0.05)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(sessions, sessions[1:]))


def test_parse_churn():
    assert sim.parse_churn("none") is None
    assert sim.parse_churn("exp:60:30") == sim.Churn(60.0, 30.0)
    assert sim.parse_churn("diurnal:60:30:0.5") == sim.Churn(60.0, 30.0, 0.5)
    for bad in ("exp", "exp:1", "exp:a:b", "exp:0:1", "diurnal:1:1:1.5", "weekly:1:1"):
        with pytest.raises(ConfigError):
            sim.parse_churn(bad)


def test_fleet_and_trace_files(tmp_path):
    fleet_csv = tmp_path / "fleet.csv"
    fleet_csv.write_text("id,s_per_sample,slowdown,stall_p,stall_s\n"
                         "a,0.01,,,\nb,0.02,5,0.2,3\n")
    fleet = sim.fleet_from_csv(str(fleet_csv))
    assert [w.id for w in fleet] == ["a", "b"]
    assert fleet[1].slowdown == 5.0 and fleet[1].stall_s == 3.0 and fleet[0].slowdown == 1.0
    (tmp_path / "some.csv").write_text("id,s_per_sample,latency_s\na,0.01,\nb,0.01,0.3\n")
    a, b = sim.fleet_from_csv(str(tmp_path / "some.csv"), latency_s=0.1, credits=1)
    assert (a.latency_s, b.latency_s, a.credits) == (0.1, 0.3, 1)  # absent columns: the defaults
    trace = tmp_path / "trace.csv"
    trace.write_text("worker,start,end\nb,0,4\nb,7,\n")
    assert sim.sessions_from_trace(str(trace)) == {"b": [(0.0, 4.0), (7.0, math.inf)]}
    (tmp_path / "bad.csv").write_text("id,s_per_sample\na,fast\n")
    with pytest.raises(ConfigError, match="not a number"):
        sim.fleet_from_csv(str(tmp_path / "bad.csv"))
    (tmp_path / "bad-trace.csv").write_text("worker,start,end\nb,5,1\n")
    with pytest.raises(ConfigError, match="must end after"):
        sim.sessions_from_trace(str(tmp_path / "bad-trace.csv"))
    with pytest.raises(ConfigError, match="cannot read"):
        sim.fleet_from_csv(str(tmp_path / "missing.csv"))


# the command --------------------------------------------------------------------------------


def test_simulate_command_prints_the_table_and_the_json_line(run_cli, tmp_path):
    code, out, err = run_cli(["simulate", "--workers", "12", "--duration", "120",
                              "--churn", "exp:60:20", "--modes", "none,replicate:2",
                              "--json", "--plot", str(tmp_path / "sim.png")])
    assert code == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["workers"] == 12
    assert set(last["modes"]) == {"none", "replicate:2"}
    for mode in last["modes"].values():
        assert set(mode) == {"samples_per_s", "wasted_fraction", "mean_staleness"}
        assert mode["samples_per_s"] > 0
    assert last["modes"]["replicate:2"]["wasted_fraction"] > last["modes"]["none"]["wasted_fraction"]
    assert last["scheduler_us_per_slot"] > 0
    assert (tmp_path / "sim.png").stat().st_size > 0


def test_simulate_command_says_what_the_evaluations_did(run_cli):
    code, out, err = run_cli(["simulate", "--workers", "4", "--duration", "30", "--modes",
                              "none", "--eval-every", "2", "--test-samples", "4096"])
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if "evaluation slots" in x]
    assert line.startswith("  none: ") and "% of the workers' compute); last version=" in line
    code, out, err = run_cli(["simulate", "--workers", "4", "--duration", "30", "--modes",
                              "none"])
    assert code == 0 and "evaluation" not in out  # costless: none unless asked for


@pytest.mark.parametrize("argv, needle", [
    (["--modes", "fancy"], "--modes: 'fancy'"),  # the flag typed, not the coordinator's
    (["--churn", "exp:1"], "churn"),
    (["--speed", "normal:1:2"], "--speed"),
    (["--fleet", "/nonexistent/fleet.csv"], "cannot read"),
    (["--target", "accuracy=0.9"], "--target needs --job"),
    (["--workers", "0"], "positive"),
])
def test_simulate_bad_input_is_one_line(run_cli, argv, needle):
    result = run_cli(["simulate", "--duration", "10", *argv])
    assert result.code != 0
    assert needle in result.one_line_error(), result.err


def test_every_figure_simulate_prints_is_explained(run_cli):
    """Each column of the table has a legend line, and a mode that wasted much says where."""
    code, out, err = run_cli(["simulate", "--workers", "12", "--duration", "60",
                              "--modes", "none,replicate:2"])
    assert code == 0, err
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("mode ")]
    assert len(starts) == 2, out  # the table's header, and the legend's first line
    columns = lines[starts[0]].split()
    legend = lines[starts[1]:]
    explained = {w.strip(":;,()") for line in legend for w in line.split()}
    assert [c for c in columns if c not in explained] == [], legend
    waste = [line for line in lines if line.startswith("  replicate:2: wasted")]
    assert waste and "slots cancelled" in waste[0], out


def test_the_readme_s_first_simulate_example_is_small():
    """The README's first `idlegrad simulate` is what a new user runs first: a fleet and a span
    that simulate in seconds (1000 workers for an hour took 259 s), not a benchmark."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    first = re.search(r"^idlegrad simulate (.*)$", readme, re.M).group(1)
    workers = int(re.search(r"--workers (\d+)", first).group(1))
    duration = float(re.search(r"--duration (\d+)", first).group(1))
    assert workers * duration <= 100 * 600, first
