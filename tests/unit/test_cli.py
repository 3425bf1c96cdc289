"""The front door: bad input ends as one line on stderr and a non-zero status, never a traceback.
Every case here fails before any socket is opened."""

from __future__ import annotations

import pytest
import torch

from idlegrad.cli.main import EXIT_USAGE, build_parser, staleness_kind
from idlegrad.common.errors import ConfigError
from idlegrad.coordinator.target import Target


@pytest.mark.parametrize("argv,needle", [
    (["bogus"], "invalid choice"),
    ([], "required"),
    (["coordinator"], "--job"),
    (["coordinator", "--job", "digits", "--epochs", "-1"], "-1"),
    (["coordinator", "--job", "digits", "--epochs=-1"], "-1"),
    (["coordinator", "--job", "digits", "--epochs", "0"], "positive"),
    (["coordinator", "--job", "digits", "--epochs", "two"], "not a number"),
    (["coordinator", "--job", "digits", "--heartbeat", "0"], "positive"),
    (["coordinator", "--job", "digits", "--seed", "-3"], "-3"),
    (["coordinator", "--job", "digits", "--staleness", "linear"], "invalid choice"),
    (["coordinator", "--job", "digits", "--no-such-flag"], "unrecognized"),
    (["coordinator", "--job", "digits", "--sync", "--async"], "not allowed with argument --sync"),
    (["worker", "--credits", "0"], "positive"),
    (["demo", "--workers", "-2"], "-2"),
    (["coordinator", "--job", "digits", "--heartbeat", "inf"], "finite"),
    (["coordinator", "--job", "digits", "--task-timeout", "nan"], "finite"),
    (["coordinator", "--job", "digits", "--bind", "nonsense"], "not a ZeroMQ address"),
    (["coordinator", "--job", "digits", "--bind", "tcp://127.0.0.1:99999"], "1 to 65535"),
    (["status", "--coordinator", "127.0.0.1:5555"], "not a ZeroMQ address"),
    (["top", "--coordinator", "tcp://127.0.0.1"], "no host:port"),
    (["worker", "--coordinator", "tcp://127.0.0.1:99999"], "1 to 65535"),
    (["demo", "--bogus"], "idlegrad demo: error: unrecognized arguments: --bogus (see idlegrad demo"),
    (["worker", "install", "--bogus"], "(see idlegrad worker install --help)"),
    # a job that fails to build names the arguments it was given
    (["coordinator", "--job", "digits", "--job-arg", "hidden=abc"], "(given --job-arg hidden='abc')"),
    # a target on a metric the job lacks: before starting, not after the first evaluation
    (["coordinator", "--job", "digits", "--target", "foo=0.5"], "its metrics are accuracy, loss"),
    # roles belong to keys
    (["coordinator", "--job", "digits", "--operator-keys", "."], "--operator-keys needs --secret-key"),
    (["coordinator", "--job", "digits", "--monitor-keys", "."], "--monitor-keys needs --secret-key"),
    (["credits"], "one of the arguments --checkpoint-dir --coordinator is required"),
    (["credits", "--checkpoint-dir", ".", "--coordinator", "tcp://127.0.0.1:1"], "not allowed with"),
    (["credits", "--coordinator", "127.0.0.1:5555"], "not a ZeroMQ address"),
    (["credits", "--checkpoint-dir", "/no/such/dir"], "--checkpoint-dir /no/such/dir: no checkpoint"),
    (["credits", "--coordinator", "tcp://127.0.0.1:1", "--secret-key", "x"], "go together"),
    # the fleet's commands
    (["ban", "--coordinator", "nope", "w1"], "--coordinator 'nope' is not a ZeroMQ address"),
    (["ban", "--coordinator", "tcp://127.0.0.1:1", "--secret-key", "x", "w1"], "go together"),
    (["invite", "--list"], "--list reads the coordinator's --enrolled folder"),
    (["invite", "--coordinator", "tcp://127.0.0.1:5555", "--secret-key", "x"],
     "or --coordinator, --coordinator-key and an operator's --secret-key"),
    (["invite", "--coordinator", "tcp://*:5555", "--coordinator-key", "k", "--secret-key", "x"],
     "not a bind address"),
    (["invite", "--coordinator", "tcp://h:5555", "--expires", "soon"], "--expires 'soon'"),
    (["worker", "status", "--coordinator", "nope"], "--coordinator: 'nope' is not a ZeroMQ"),
])
def test_usage_errors(run_cli, argv, needle):
    result = run_cli(argv)
    assert result.code == EXIT_USAGE == 2
    assert needle in result.one_line_error()
    assert result.out == ""


def test_a_flags_error_names_the_flag_once(run_cli):
    line = run_cli(["worker", "--coordinator", "foo"]).one_line_error()
    assert line == ("idlegrad worker: error: --coordinator: 'foo' is not a ZeroMQ address like "
                    "tcp://127.0.0.1:5555")
    # where the flag and the file's key differ, both are named
    assert "--cpu-max: idle.cpu_others_max_pct:" in run_cli(
        ["worker", "--cpu-max", "200"]).one_line_error()


@pytest.mark.parametrize("target", ["accuracy", "accuracy=high", "=0.5", "acc<0.5", "loss<=nan",
                                    "accuracy=inf"])
def test_bad_target(run_cli, target):
    result = run_cli(["coordinator", "--job", "digits", "--target", target])
    assert result.code == 2
    line = result.one_line_error()
    assert line.startswith("idlegrad coordinator: error:") and "target" in line


def test_unknown_job(run_cli):
    result = run_cli(["coordinator", "--job", "no_such_job_anywhere"])
    assert result.code == 2
    assert "unknown job" in result.one_line_error()


def test_job_file_missing(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["coordinator", "--job", "nope.py:x"])
    assert result.code == 2
    assert "does not exist" in result.one_line_error()


def test_bad_job_arg(run_cli):
    result = run_cli(["coordinator", "--job", "digits", "--job-arg", "oops"])
    assert result.code == 2
    assert "name=value" in result.one_line_error()
    result = run_cli(["coordinator", "--job", "digits", "--job-arg", "nonsense=1"])
    assert result.code == 2
    assert "does not take" in result.one_line_error()
    # what a worker would refuse in the welcome, the coordinator refuses at the start
    result = run_cli(["coordinator", "--job", "digits", "--job-arg", "name=" + "x" * 300])
    assert result.code == 2
    assert "--job-arg.name: string over 256 characters" in result.one_line_error()
    result = run_cli(["coordinator", "--job", "digits", "--job-arg", f"hidden={2**64}"])
    assert result.code == 2
    assert "--job-arg.hidden: int out of range" in result.one_line_error()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_worker_cuda_without_cuda(run_cli):
    # --no-low-priority: the worker would otherwise nice this very process (pytest) to 19
    result = run_cli(["worker", "--device", "cuda", "--no-low-priority"])
    assert result.code != 0
    assert "cuda" in result.one_line_error().lower()


def test_worker_unknown_device(run_cli):
    result = run_cli(["worker", "--device", "toaster"])
    assert result.code == 2
    assert "toaster" in result.one_line_error()


def test_worker_unknown_job_is_one_line_before_connecting(run_cli):
    # --no-low-priority: the worker would otherwise nice this very process (pytest) to 19
    result = run_cli(["worker", "--job", "nosuch", "--no-low-priority", "--connect-timeout", "60"])
    assert result.code == 2
    assert "unknown job 'nosuch'" in result.one_line_error()


def test_version_and_help(run_cli):
    code, out, _ = run_cli(["--version"])
    assert code == 0 and out.startswith("idlegrad ")
    code, out, _ = run_cli(["coordinator", "--help"])
    assert code == 0 and "--checkpoint-dir" in out


def test_parser_defaults():
    args = build_parser().parse_args(["coordinator", "--job", "digits"])
    assert (args.epochs, args.target, args.partitions, args.open_rounds, args.staleness,
            args.max_staleness, args.job_arg) == (None, None, 1, 0, None, 32, [])
    assert staleness_kind(args) == "inverse"
    piped = build_parser().parse_args(["coordinator", "--job", "digits", "--pipeline", "2"])
    assert (piped.pipeline, staleness_kind(piped)) == (2, "constant")
    chosen = build_parser().parse_args(["coordinator", "--job", "digits", "--pipeline", "2",
                                        "--staleness", "sqrt"])
    assert staleness_kind(chosen) == "sqrt"
    from idlegrad.cli.worker_cli import settings_of

    # Worker defaults live in worker/config.py; the flags only override them.
    settings, _ = settings_of(build_parser().parse_args(["worker", "--config", "/dev/null"]))
    assert settings.device == "auto" and settings.credits == 2 and settings.job is None


# targets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,metric,value,higher", [
    ("accuracy=0.95", "accuracy", 0.95, True),
    ("loss=0.1", "loss", 0.1, False),
    ("val_loss=0.3", "val_loss", 0.3, False),
    ("error=0.05", "error", 0.05, False),
    ("Perplexity=20", "Perplexity", 20.0, False),
    ("loss<=0.2", "loss", 0.2, False),
    ("acc>=0.5", "acc", 0.5, True),
    ("loss>=0.2", "loss", 0.2, True),  # an explicit operator wins over the name
    ("accuracy<=0.9", "accuracy", 0.9, False),
    (" accuracy = 0.95 ", "accuracy", 0.95, True),
    ("f1=1e-1", "f1", 0.1, True),
])
def test_target_parse(text, metric, value, higher):
    t = Target.parse(text)
    assert (t.metric, t.value, t.higher_is_better) == (metric, value, higher)


@pytest.mark.parametrize("text", ["", "accuracy", "=0.5", "accuracy=", "accuracy=abc",
                                  "accuracy=nan", "loss<=inf", "acc>0.5", "acc<0.5", ">=1",
                                  "accuracy=0.5=0.6", "   =1"])
def test_target_parse_errors(text):
    with pytest.raises(ConfigError) as e:
        Target.parse(text)
    assert "\n" not in str(e.value)


def test_target_reached_and_str():
    acc = Target.parse("accuracy=0.9")
    assert acc.reached({"accuracy": 0.9}) and acc.reached({"accuracy": 0.95})
    assert not acc.reached({"accuracy": 0.89}) and not acc.reached({"loss": 0.0})
    loss = Target.parse("loss=0.1")
    assert loss.reached({"loss": 0.1}) and loss.reached({"loss": 0.05})
    assert not loss.reached({"loss": 0.2})
    assert str(acc) == "accuracy>=0.9" and str(loss) == "loss<=0.1"
    assert Target.parse(str(loss)) == loss and Target.parse(str(acc)) == acc


@pytest.mark.parametrize("flag,make", [
    ("--checkpoint-dir", lambda d: d / "a-file"),  # a file where a directory must go
    ("--checkpoint-dir", lambda d: d / "a-file" / "sub"),
    ("--metrics", lambda d: d),  # a directory where the file must go
    ("--ledger", lambda d: d / "a-file" / "ledger.jsonl"),
])
def test_paths_the_coordinator_cannot_write_are_one_line(run_cli, tmp_path, flag, make):
    (tmp_path / "a-file").write_text("x")
    result = run_cli(["coordinator", "--job", "digits", flag, str(make(tmp_path))])
    assert result.code == EXIT_USAGE
    assert f"{flag} " in result.one_line_error() and "cannot write there" in result.err


def test_coordinator_help_lists_every_builtin_job(run_cli):
    from idlegrad.common.job_loading import builtin_job_names

    code, out, _ = run_cli(["coordinator", "--help"])
    assert code == 0
    flat = " ".join(out.split())  # argparse wraps the help
    for name in builtin_job_names():
        assert name in flat, name
    assert "packed, resnet" in flat or "lm, packed" in flat


def test_a_port_in_use_is_one_line_before_anything_is_built(run_cli, monkeypatch):
    import socket

    from idlegrad.coordinator import server

    def built(self, config):
        raise AssertionError("the coordinator was built before its port was found taken")

    monkeypatch.setattr(server.Coordinator, "__init__", built)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        code, out, err = run_cli(["coordinator", "--job", "digits", "--bind", address])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"idlegrad coordinator: error: cannot bind {address}: Address already in use")


def test_a_coordinator_refuses_open_binds_and_bad_keys_in_one_line(run_cli, tmp_path):
    """(From tests/integration/test_security.py, which keeps one of each with a real process.)
    Without keys it listens on loopback only; keys that do not go together, a public key given
    for the secret one, a file for a key folder, a role folder that is not there: one line,
    status 2, before any socket is opened."""
    from idlegrad.common import security

    for bind in ("tcp://*:5555", "tcp://0.0.0.0:5555"):
        result = run_cli(["coordinator", "--job", "digits", "--bind", bind])
        line = result.one_line_error()
        assert result.code == 2 and "refusing to listen" in line and "--insecure" in line, line
    keys = tmp_path / "keys"
    security.generate("coord", str(keys))
    secret, public = str(keys / "coord.key_secret"), str(keys / "coord.key")
    nowhere = str(tmp_path / "nowhere")
    for args, expected in ((["--secret-key", secret], "go together"),
                           (["--secret-key", public, "--allow-keys", str(keys)],
                            "holds no secret key"),
                           (["--secret-key", secret, "--allow-keys", public],
                            "no such directory"),  # a file: refused, not made
                           (["--operator-keys", str(keys)], "--operator-keys needs --secret-key"),
                           (["--secret-key", secret, "--allow-keys", str(keys),
                             "--monitor-keys", nowhere], f"--monitor-keys {nowhere}: no such "
                                                        "directory")):
        result = run_cli(["coordinator", "--job", "digits", "--bind", "tcp://127.0.0.1:5555",
                          *args])
        assert result.code == 2 and expected in result.one_line_error(), (args, result)
