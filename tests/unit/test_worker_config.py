"""Worker settings (worker/config.py, cli/worker_cli.py): TOML file, flags over it, one-line errors
naming the key, --print-config round trip."""

from __future__ import annotations

import pytest

from idlegrad.cli.main import EXIT_USAGE, build_parser
from idlegrad.cli.worker_cli import settings_of
from idlegrad.common.errors import ConfigError
from idlegrad.worker import config
from idlegrad.worker.config import Settings, from_toml_text, resolve_cores


@pytest.fixture(autouse=True)
def no_home_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


FULL = """
coordinator = "tcp://10.0.0.5:5555"
job = "digits"
credits = 3
[limits]
max_cores = "50%"
memory_max_mb = 2048
hours = ["22:00-07:00", "12:00-13:00"]
low_priority = false
[idle]
resume_after = 30
cpu_others_max_pct = false
user_idle_min_s = 600
pause_on_battery = false
pause_when_unknown = ["user"]
"""


def test_full_file():
    s = from_toml_text(FULL, "w.toml")
    assert s.coordinator == "tcp://10.0.0.5:5555" and s.credits == 3 and s.job == "digits"
    assert s.max_cores == "50%" and s.memory_max_mb == 2048 and not s.low_priority
    assert s.hours == ("22:00-07:00", "12:00-13:00")
    assert s.resume_after == 30 and s.cpu_others_max_pct is None and s.user_idle_min_s == 600
    p = s.policy()
    assert p.cpu_others_max_pct is None and p.worker_rss_max_mb == 2048
    assert p.hours == ((1320, 420), (720, 780)) and p.pause_when_unknown == {"user"}
    assert not p.pause_on_battery
    assert s.threads_for(8) == 4 and s.threads_for(1) == 1


def test_print_config_round_trips():
    s = from_toml_text(FULL, "w.toml")
    again = from_toml_text(config.to_toml(s, "w.toml", 8), "printed")
    assert again == s
    assert from_toml_text(config.to_toml(Settings()), "printed") == Settings()


@pytest.mark.parametrize("text,needle", [
    ("credits = 0", "credits: must be >= 1"),
    ("credits = 'two'", "credits: 'two' is not a number"),
    ("coordinator = 'localhost'", "coordinator"),
    ("device = 'tpu'", "device"),
    ("bogus = 1", "unknown key bogus"),
    ("[idle]\nresume_after = -1", "idle.resume_after: must be >= 0"),
    ("[idle]\nresum_after = 1", "unknown key idle.resum_after"),
    ("[idle]\ncpu_others_max_pct = 150", "idle.cpu_others_max_pct"),
    ("[idle]\ncpu_others_max_pct = true", "idle.cpu_others_max_pct"),
    ("[idle]\npause_on_battery = 'maybe'", "idle.pause_on_battery"),
    ("[idle]\npause_when_unknown = ['mouse']", "idle.pause_when_unknown: unknown rules"),
    ("[idle]\nsample_every = 0.001", "idle.sample_every"),
    ("[limits]\nhours = ['9-5']", "limits.hours"),
    ("[limits]\nmax_cores = '150%'", "limits.max_cores"),
    ("[limits]\nmax_cores = 0", "limits.max_cores"),
    ("[limits]\nmemory_max_mb = 0", "limits.memory_max_mb"),
    ("limits = 3", "[limits] must be a table"),
    ("credits = ", "not valid TOML"),
])
def test_bad_file_values_name_the_key(text, needle):
    with pytest.raises(ConfigError) as info:
        from_toml_text(text, "worker.toml")
    message = str(info.value)
    assert needle in message and message.startswith("worker.toml: ") and "\n" not in message


def test_flags_override_the_file(tmp_path, run_cli):
    path = tmp_path / "w.toml"
    path.write_text(FULL)
    code, out, err = run_cli(["worker", "--config", str(path), "--credits", "5",
                              "--cpu-max", "30", "--hours", "any", "--print-config"])
    assert code == 0, err
    printed = from_toml_text(out, "printed")
    assert printed.credits == 5 and printed.cpu_others_max_pct == 30 and printed.hours == ()
    assert printed.coordinator == "tcp://10.0.0.5:5555"  # from the file
    assert "from " + str(path) in out


def test_default_file_is_read(tmp_path, run_cli):
    (tmp_path / "xdg" / "idlegrad").mkdir(parents=True)
    (tmp_path / "xdg" / "idlegrad" / "worker.toml").write_text("credits = 7\n")
    code, out, _ = run_cli(["worker", "--print-config"])
    assert code == 0 and "credits = 7" in out


@pytest.mark.parametrize("argv,needle", [
    (["worker", "--resume-after", "soon"], "--resume-after: idle.resume_after"),
    (["worker", "--cpu-max", "200"], "--cpu-max: idle.cpu_others_max_pct"),
    (["worker", "--max-cores", "lots"], "--max-cores: limits.max_cores"),
    (["worker", "--hours", "25:00-01:00"], "--hours: limits.hours"),
    (["worker", "--pause-when-unknown", "cpu,mouse"], "unknown rules"),
    (["worker", "--config", "/nonexistent/w.toml"], "no such file"),
    (["worker", "install", "--print", "--memory-max", "-5"], "--memory-max"),
    (["worker", "--id", "w" * 129], "at most 128 characters"),
])
def test_bad_flags_are_one_line(run_cli, argv, needle):
    result = run_cli(argv)
    assert result.code == EXIT_USAGE
    assert needle in result.one_line_error(), result.err


def test_bad_file_is_one_line(tmp_path, run_cli):
    path = tmp_path / "w.toml"
    path.write_text("[idle]\nresume_after = 'never'\n")
    code, _, err = run_cli(["worker", "--config", str(path)])
    assert code == EXIT_USAGE
    assert err.strip().count("\n") == 0 and "idle.resume_after" in err


def test_no_idle_policy_keeps_the_owner_limits():
    args = build_parser().parse_args(["worker", "--no-idle-policy", "--memory-max", "100",
                                      "--hours", "09:00-17:00"])
    s, _ = settings_of(args)
    p = s.policy()
    assert p.cpu_others_max_pct is None and p.user_idle_min_s is None and not p.pause_on_battery
    assert p.memory_available_min_mb is None and p.gpu_others_max_pct is None
    assert p.worker_rss_max_mb == 100 and p.hours == ((540, 1020),)


def test_plain_worker_flags_still_parse():
    args = build_parser().parse_args(["worker", "--coordinator", "tcp://h:1", "--threads", "2",
                                      "--id", "x", "--connect-timeout", "0"])
    s, _ = settings_of(args)
    assert (s.coordinator, s.threads, s.id, s.connect_timeout) == ("tcp://h:1", 2, "x", 0.0)
    assert args.worker_action is None


@pytest.mark.parametrize("spec,usable,cores", [
    (None, 8, None), ("3", 8, 3), ("30", 8, 8), ("50%", 8, 4), ("10%", 4, 1), ("100%", 6, 6),
])
def test_resolve_cores(spec, usable, cores):
    assert resolve_cores(spec, usable) == cores


def test_a_worker_waits_for_its_coordinator_forever_unless_told_otherwise(tmp_path):
    """The README's "start it again ... the workers reconnect by themselves" holds for any
    restart: no timeout by default, neither from flags nor from the file `worker join` writes."""
    from idlegrad.worker.daemon import WorkerConfig

    joined = tmp_path / "worker.toml"
    joined.write_text('coordinator = "tcp://h:1"\nid = "alice-1"\n')  # what join writes, keys aside
    for argv in (["worker"], ["worker", "--config", str(joined)]):
        s, _ = settings_of(build_parser().parse_args(argv))
        assert s.connect_timeout == 0, argv
    assert WorkerConfig().connect_timeout == 0
    s, _ = settings_of(build_parser().parse_args(["worker", "--connect-timeout", "30"]))
    assert s.connect_timeout == 30  # opt-in


def test_a_waiting_worker_says_so_every_so_often_and_names_the_keys_only_with_keys():
    from idlegrad.worker.waiting import Waiting

    waiting = Waiting("tcp://h:5555", keys=True, since=100.0)
    said = {t: waiting.report(100.0 + t) for t in range(0, 2000, 5)}
    lines = {t: line for t, line in said.items() if line}
    assert list(lines) == [30, 120, 600, 1200, 1800], lines
    assert lines[120] == ("no answer from tcp://h:5555 for 2m; still trying "
                          "(is it running? do the keys match?)")
    plain = Waiting("tcp://h:5555", keys=False, since=0.0)
    assert "keys" not in plain.report(31.0)
    assert plain.report(5000.0).endswith("for 1h23m; still trying (is it running?)")
    assert plain.report(5001.0) is None  # one report for a long sleep, not one per missed one


def test_the_worker_log_confirms_no_idle_policy_and_the_limits_that_still_hold(run_cli, caplog):
    from idlegrad.cli.processes import free_port

    caplog.set_level("INFO", logger="idlegrad")
    code, _, _ = run_cli(["worker", "--no-idle-policy", "--hours", "09:00-17:00",
                            "--coordinator", f"tcp://127.0.0.1:{free_port()}",
                            "--connect-timeout", "0.3", "--device", "cpu", "--threads", "1",
                            "--no-low-priority"])
    assert code != 0  # nobody answers
    assert ("idle policy: off (--no-idle-policy): computing whatever the machine does; the "
            "owner's limits still hold: hours 09:00-17:00") in caplog.text, caplog.text
    s, _ = settings_of(build_parser().parse_args(["worker"]))
    from idlegrad.worker.idle import describe_policy

    assert describe_policy(s.policy()).startswith("pausing when others use over 25% CPU, user "
                                                  "input within 180s, on battery")
