"""CURVE key files, the client key pair, and the loopback check (no sockets)."""

from __future__ import annotations

import os

import pytest

from idlegrad.common import security
from idlegrad.common.errors import ConfigError
from idlegrad.coordinator.config import check
from idlegrad.coordinator.server import Coordinator, CoordinatorConfig
from idlegrad.worker import config

from .fakes import RecordingTransport


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:5555", "tcp://127.3.4.5:1", "tcp://localhost:5555", "tcp://[::1]:5555",
    "ipc:///tmp/idlegrad.sock", "inproc://x"])
def test_loopback_addresses(address):
    assert security.is_loopback(address)


@pytest.mark.parametrize("address", [
    "tcp://*:5555", "tcp://0.0.0.0:5555", "tcp://eth0:5555", "tcp://10.0.0.1:5555",
    "tcp://[::]:5555", "tcp://192.168.1.2:5555", "tcp://example.org:5555", "udp://127.0.0.1:1",
    "127.0.0.1:5555", "tcp://[::1:5555", ""])
def test_addresses_beyond_loopback(address):
    assert not security.is_loopback(address)


def test_generate_and_load(tmp_path):
    umask = os.umask(0o022)  # a usual one: the public half readable by others
    try:
        public_path, secret_path = security.generate("w1", str(tmp_path / "keys"))
    finally:
        os.umask(umask)
    assert os.stat(secret_path).st_mode & 0o777 == 0o600  # the owner's alone
    assert os.stat(public_path).st_mode & 0o777 == 0o644
    assert public_path.endswith("w1.key") and secret_path.endswith("w1.key_secret")
    public = security.load_public(public_path)
    assert security.load_keypair(secret_path)[0] == public
    assert security.load_public(secret_path) == public
    assert security.load_allowed(str(tmp_path / "keys")) == frozenset({public})
    with pytest.raises(ConfigError, match="exists"):
        security.generate("w1", str(tmp_path / "keys"))
    with pytest.raises(ConfigError, match="no secret key"):
        security.load_keypair(public_path)
    for bad in ("", "a/b", ".."):
        with pytest.raises(ConfigError, match="plain file name"):
            security.generate(bad, str(tmp_path))


def test_load_errors_are_one_line(tmp_path):
    junk = tmp_path / "junk.key"
    junk.write_text("public-key = \"short\"\n")
    with pytest.raises(ConfigError, match="no such file"):
        security.load_public(str(tmp_path / "missing.key"))
    with pytest.raises(ConfigError, match="public key"):
        security.load_public(str(junk))
    with pytest.raises(ConfigError, match="no such directory"):
        security.load_allowed(str(tmp_path / "nowhere"))


def test_client_keys_both_or_neither(tmp_path):
    security.generate("coord", str(tmp_path))
    security.generate("w", str(tmp_path))
    assert security.client_keys(None, None) is None
    with pytest.raises(ConfigError, match="go together"):
        security.client_keys(str(tmp_path / "coord.key"), None)
    with pytest.raises(ConfigError, match="go together"):
        security.client_keys(None, str(tmp_path / "w.key_secret"))
    keys = security.client_keys(str(tmp_path / "coord.key"), str(tmp_path / "w.key_secret"))
    assert keys.server_public == security.load_public(str(tmp_path / "coord.key"))
    assert keys.public == security.load_public(str(tmp_path / "w.key"))


def _check(tmp_path, **kw):
    checked = check(CoordinatorConfig(job="digits", **kw))
    return checked.keypair, checked.allowed


def test_coordinator_security_settings(tmp_path, caplog):
    assert _check(tmp_path) == (None, None)  # loopback by default
    with pytest.raises(ConfigError, match="refusing to listen on tcp://\\*:5555"):
        _check(tmp_path, bind="tcp://*:5555")
    with caplog.at_level("WARNING"):
        assert _check(tmp_path, bind="tcp://*:5555", insecure=True) == (None, None)
    assert "WITHOUT encryption" in caplog.text
    security.generate("coord", str(tmp_path / "k"))
    security.generate("w", str(tmp_path / "allow"))
    keypair, allowed = _check(tmp_path, bind="tcp://*:5555",
                              secret_key=str(tmp_path / "k" / "coord.key_secret"),
                              allow_keys=str(tmp_path / "allow"))
    assert keypair[0] == security.load_public(str(tmp_path / "k" / "coord.key"))
    assert allowed == {security.load_public(str(tmp_path / "allow" / "w.key"))}
    with pytest.raises(ConfigError, match="go together"):
        _check(tmp_path, allow_keys=str(tmp_path / "allow"))


def test_worker_config_takes_key_paths(tmp_path):
    settings = config.from_toml_text(
        'coordinator = "tcp://host:5555"\ncoordinator_key = "coord.key"\n'
        'secret_key = "/etc/idlegrad/me.key_secret"\n', "worker.toml")
    assert settings.coordinator_key == "coord.key"
    assert settings.secret_key == "/etc/idlegrad/me.key_secret"
    with pytest.raises(ConfigError, match="secret_key"):
        config.from_toml_text("secret_key = 3\n", "worker.toml")
    assert "coordinator_key" in config.to_toml(settings)


def test_keys_of_other_roles_need_keys_and_readable_folders(tmp_path):
    security.generate("coord", str(tmp_path / "k"))
    security.generate("w", str(tmp_path / "allow"))
    curve = dict(secret_key=str(tmp_path / "k" / "coord.key_secret"),
                 allow_keys=str(tmp_path / "allow"))
    for flag, field in (("--operator-keys", "operator_keys"), ("--monitor-keys", "monitor_keys")):
        with pytest.raises(ConfigError, match=f"^{flag} needs --secret-key and --allow-keys"):
            _check(tmp_path, **{field: str(tmp_path / "allow")})
        with pytest.raises(ConfigError, match=f"^{flag} .*nowhere: no such directory$"):
            _check(tmp_path, **curve, **{field: str(tmp_path / "nowhere")})
    security.generate("op", str(tmp_path / "ops"))
    security.generate("mon", str(tmp_path / "mons"))
    checked = check(CoordinatorConfig(job="digits", **curve, operator_keys=str(tmp_path / "ops"),
                                      monitor_keys=str(tmp_path / "mons")))
    assert checked.keys.operators == {security.load_public(str(tmp_path / "ops" / "op.key"))}
    assert checked.keys.monitors == {security.load_public(str(tmp_path / "mons" / "mon.key"))}
    assert checked.keys.workers == checked.allowed


def _control(coordinator, key: bytes, action: str = "pause"):
    import asyncio

    import zmq

    from idlegrad.common import protocol as proto

    frames = [zmq.Frame(f) for f in (b"route", *proto.encode(proto.Control(action=action)))]
    asyncio.run(coordinator.handle(frames, key=key))


def test_a_worker_keys_pause_is_refused_and_counted_an_operators_is_done(tmp_path):
    from idlegrad.common import protocol as proto

    keys, allowed, operators = tmp_path / "keys", tmp_path / "allowed", tmp_path / "operators"
    security.generate("coordinator", keys)
    security.generate("w1", allowed)
    security.generate("alice", operators)
    coordinator = Coordinator(CoordinatorConfig(
        job="digits", secret_key=str(keys / "coordinator.key_secret"), allow_keys=str(allowed),
        operator_keys=str(operators)))
    (worker_key,) = coordinator.gate.keys.workers
    (operator_key,) = coordinator.gate.keys.operators
    coordinator.transport = transport = RecordingTransport()
    _control(coordinator, worker_key)
    (_, reply), = transport.sent
    assert isinstance(reply, proto.ControlReply) and not reply.ok and reply.action == "pause"
    assert "--operator-keys" in reply.detail
    assert not coordinator.scheduler.paused
    assert coordinator.counters["controls_refused"] == 1
    assert coordinator.snapshot()["counters"]["controls_refused"] == 1
    transport.sent.clear()
    _control(coordinator, operator_key)
    (_, reply), = transport.sent
    assert reply.ok and coordinator.scheduler.paused


def test_a_banned_key_still_listed_is_not_heard(tmp_path):
    """A ban is of the key: a monitor's commands need no hello, so without this a banned worker
    whose key is still an operator's could pause training or drain the others."""
    import asyncio

    import zmq

    from idlegrad.common import protocol as proto

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    security.generate("coordinator", keys)
    security.generate("evil", allowed)
    coordinator = Coordinator(CoordinatorConfig(
        job="digits", secret_key=str(keys / "coordinator.key_secret"), allow_keys=str(allowed),
        operator_keys=str(allowed)))
    (evil_key,) = coordinator.gate.allowed
    coordinator.transport = transport = RecordingTransport()

    def control():
        frames = [zmq.Frame(f) for f in (b"route", *proto.encode(proto.Control(action="pause")))]
        asyncio.run(coordinator.handle(frames, key=evil_key))

    control()
    assert coordinator.scheduler.paused and isinstance(transport.sent[-1][1], proto.ControlReply)
    asyncio.run(coordinator.control("resume"))
    identity = "key:" + evil_key.decode()
    for t in range(3):  # non-finite gradients: an offence each, banned after --ban-after (3)
        coordinator.core.trust.judge(identity, float("nan"), 1.0, float(t))
    assert coordinator.core.trust.is_banned(identity)
    transport.sent.clear()
    control()
    assert not coordinator.scheduler.paused and transport.sent == []
    assert coordinator.counters["messages_banned_key"] == 1


@pytest.mark.parametrize("address,bind", [
    ("tcp://127.0.0.1:5555", False), ("tcp://coordinator.example:1", False),
    ("tcp://[::1]:65535", False), ("tcp://*:5555", True), ("tcp://127.0.0.1:*", True),
    ("ipc:///tmp/idlegrad.sock", False), ("inproc://x", False),
])
def test_addresses_zeromq_can_use(address, bind):
    assert security.check_address(address, "--bind", bind=bind) == address


@pytest.mark.parametrize("address,bind,needle", [
    ("127.0.0.1:5555", False, "is not a ZeroMQ address"),  # the likely typo
    ("nonsense", True, "is not a ZeroMQ address"),
    ("tcp://", False, "is not a ZeroMQ address"),
    ("tcp://127.0.0.1", False, "no host:port"),
    ("tcp://:5555", False, "no host:port"),
    ("tcp://127.0.0.1:99999", True, "from 1 to 65535"),  # ZeroMQ would take 34463
    ("tcp://127.0.0.1:0", False, "from 1 to 65535"),
    ("tcp://127.0.0.1:*", False, "from 1 to 65535"),  # connect needs a port
    ("udp://127.0.0.1:5555", False, "transport 'udp' unknown"),
])
def test_addresses_refused_in_one_line(address, bind, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        security.check_address(address, "--coordinator", bind=bind)
    assert str(e.value).startswith("--coordinator ") and "\n" not in str(e.value)


def test_a_missing_allow_keys_folder_is_made_and_said(tmp_path, caplog):
    """The README's first commands name --allow-keys allowed/ before any key is in it."""
    security.generate("coord", str(tmp_path / "k"))
    allowed = tmp_path / "allowed"
    with caplog.at_level("WARNING"):
        _, keys = _check(tmp_path, secret_key=str(tmp_path / "k" / "coord.key_secret"),
                         allow_keys=str(allowed))
    assert allowed.is_dir() and keys == frozenset()
    assert "did not exist: made it" in caplog.text and "SIGHUP" in caplog.text
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="no such directory"):  # not a folder: not replaced
        _check(tmp_path, secret_key=str(tmp_path / "k" / "coord.key_secret"),
               allow_keys=str(tmp_path / "file"))


def test_worker_job_arg_says_where_job_arguments_come_from(run_cli):
    code, out, err = run_cli(["worker", "--job-arg", "hidden=128"])
    assert code == 2 and err.count("\n") == 1, err
    assert "a worker gets the job's arguments from its coordinator" in err
