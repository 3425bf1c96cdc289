"""Several projects in worker.toml ([[project]] tables): parsed, printed back, bad ones refused in
one line naming the table and the key; a file without them is the one coordinator of before."""

from __future__ import annotations

import pytest

from idlegrad.cli.main import EXIT_USAGE
from idlegrad.common.errors import ConfigError
from idlegrad.worker import config
from idlegrad.worker.config import Project, from_toml_text


@pytest.fixture(autouse=True)
def no_home_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


TWO = """
credits = 3
[limits]
max_cores = 2
[[project]]
name = "vision"
coordinator = "tcp://10.0.0.5:5555"
share = 3
job = "digits"
[[project]]
coordinator = "tcp://10.0.0.6:5555"
credits = 1
coordinator_key = "keys/b.key"
secret_key = "keys/me.key_secret"
"""


def test_projects_are_parsed_with_their_own_settings():
    s = from_toml_text(TWO, "w.toml")
    assert s.projects == (
        Project(coordinator="tcp://10.0.0.5:5555", share=3, name="vision", job="digits"),
        Project(coordinator="tcp://10.0.0.6:5555", credits=1, coordinator_key="keys/b.key",
                secret_key="keys/me.key_secret"))
    assert [p.label for p in s.projects] == ["vision", "tcp://10.0.0.6:5555"]
    assert s.credits == 3 and s.max_cores == "2"  # one set of owner limits, for all


def test_projects_print_and_read_back():
    s = from_toml_text(TWO, "w.toml")
    assert from_toml_text(config.to_toml(s, "w.toml", 8), "printed") == s


def test_a_file_without_projects_is_one_coordinator_as_before():
    s = from_toml_text('coordinator = "tcp://10.0.0.5:5555"\n', "w.toml")
    assert s.projects == () and s.coordinator == "tcp://10.0.0.5:5555"
    assert "[[project]]" not in config.to_toml(s)


@pytest.mark.parametrize("text,needle", [
    ("[[project]]\nshare = 1", "[[project]] 1: coordinator: missing"),
    ("[[project]]\ncoordinator = 'tcp://a:1'\nshare = 0", "[[project]] 1: share: must be > 0"),
    ("[[project]]\ncoordinator = 'tcp://a:1'\nshare = 'big'", "[[project]] 1: share"),
    ("[[project]]\ncoordinator = 'tcp://a:1'\n[[project]]\ncoordinator = 'nowhere'",
     "[[project]] 2: coordinator"),
    ("[[project]]\ncoordinator = 'tcp://a:1'\ncredits = 0", "[[project]] 1: credits: must be >= 1"),
    ("[[project]]\ncoordinator = 'tcp://a:1'\nhours = 3", "[[project]] 1: unknown key hours"),
    ("[[project]]\ncoordinator = 'tcp://a:1'\n[[project]]\ncoordinator = 'tcp://a:1'",
     "must differ in name"),
    ("project = 3", "project must be [[project]] tables"),
    ("coordinator = 'tcp://a:1'\n[[project]]\ncoordinator = 'tcp://b:1'",
     "coordinator: set it in each [[project]]"),
])
def test_bad_projects_are_one_line(text, needle):
    with pytest.raises(ConfigError) as info:
        from_toml_text(text, "worker.toml")
    message = str(info.value)
    assert needle in message and message.startswith("worker.toml: ") and "\n" not in message


def test_a_coordinator_flag_with_projects_is_one_line(tmp_path, run_cli):
    path = tmp_path / "w.toml"
    path.write_text(TWO)
    result = run_cli(["worker", "--config", str(path), "--coordinator", "tcp://c:1"])
    assert result.code == EXIT_USAGE
    assert "--coordinator" in result.one_line_error() and "[[project]]" in result.err


def test_print_config_shows_the_projects(tmp_path, run_cli):
    path = tmp_path / "w.toml"
    path.write_text(TWO)
    code, out, err = run_cli(["worker", "--config", str(path), "--credits", "4", "--print-config"])
    assert code == 0, err
    printed = from_toml_text(out, "printed")
    assert printed.credits == 4 and printed.projects == from_toml_text(TWO, "w").projects
