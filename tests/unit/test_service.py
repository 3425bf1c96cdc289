"""`idlegrad worker install --print` (worker/service.py): the systemd unit and the launchd agent,
rendered from packaging/ templates; the systemd unit passes `systemd-analyze verify` where it exists."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys

import pytest

from idlegrad.worker import service


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def printed(run_cli, *argv) -> tuple[str, str]:
    code, out, err = run_cli(["worker", "install", "--print", *argv])
    assert code == 0, err
    first, _, body = out.partition("\n")
    assert first.startswith("# ")
    return first[2:], body


def directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_systemd_user_unit(run_cli, tmp_path):
    path, unit = printed(run_cli, "--format", "systemd", "--coordinator", "tcp://10.0.0.5:5555",
                          "--memory-max", "2048", "--max-cores", "2", "--cpu-max", "30")
    assert path == str(tmp_path / "xdg" / "systemd" / "user" / "idlegrad-worker.service")
    assert not os.path.exists(path), "--print wrote the file"
    d = directives(unit)
    assert d["ExecStart"] == [f"{sys.executable} -m idlegrad.cli worker --coordinator "
                              "tcp://10.0.0.5:5555 --memory-max 2048 --max-cores 2 --cpu-max 30 "
                              "--connect-timeout 0"]
    assert d["Nice"] == ["19"] and d["CPUSchedulingPolicy"] == ["idle"]
    assert d["IOSchedulingClass"] == ["idle"] and d["Restart"] == ["on-failure"]
    assert d["MemoryMax"] == ["2048M"] and d["WantedBy"] == ["default.target"]
    assert "DynamicUser" not in d and "@" not in unit
    cores = min(2, service.usable_cores())
    assert d["CPUQuota"] == [f"{cores * 100}%"]


def test_systemd_system_unit_and_quoting(run_cli):
    path, unit = printed(run_cli, "--format", "systemd", "--system", "--state-log",
                          "/var/x y/50%.log", "--connect-timeout", "5", "--no-low-priority",
                          "--battery", "run")
    assert path == "/etc/systemd/system/idlegrad-worker.service"
    d = directives(unit)
    assert d["DynamicUser"] == ["yes"] and d["WantedBy"] == ["multi-user.target"]
    (exec_start,) = d["ExecStart"]
    assert '"/var/x y/50%%.log"' in exec_start  # spaces quoted, % escaped for systemd
    assert exec_start.endswith("--connect-timeout 0") and "--connect-timeout 5" not in exec_start
    assert "--no-low-priority --battery run" in exec_start or \
        "--battery run" in exec_start and "--no-low-priority" in exec_start
    assert "MemoryMax" not in d  # no ceiling given


def test_launchd_agent(run_cli, tmp_path):
    path, text = printed(run_cli, "--format", "launchd", "--coordinator", "tcp://h:5555",
                          "--hours", "22:00-07:00", "--job", "a&b.py:make")
    assert path == str(tmp_path / "home" / "Library" / "LaunchAgents" / "org.idlegrad.worker.plist")
    plist = plistlib.loads(text.encode())
    assert plist["Label"] == "org.idlegrad.worker"
    assert plist["ProgramArguments"] == [
        sys.executable, "-m", "idlegrad.cli", "worker", "--coordinator", "tcp://h:5555",
        "--hours", "22:00-07:00", "--job", "a&b.py:make", "--connect-timeout", "0"]
    assert plist["Nice"] == 19 and plist["LowPriorityIO"] is True
    assert plist["ProcessType"] == "Background" and plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}


def test_install_validates_settings_first(run_cli, tmp_path):
    code, out, err = run_cli(["worker", "install", "--format", "systemd", "--resume-after", "x"])
    assert code == 2 and "idle.resume_after" in err and out == ""
    assert not (tmp_path / "xdg" / "systemd").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd paths")
def test_install_without_a_service_manager_writes_the_unit_and_says_so(run_cli, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no systemctl
    result = run_cli(["worker", "install", "--coordinator", "tcp://h:1"])
    path = tmp_path / "xdg" / "systemd" / "user" / "idlegrad-worker.service"
    assert result.code == 1 and path.exists()
    line = result.one_line_error()
    assert "systemctl" in line and str(path) in line
    code, out, err = run_cli(["worker", "uninstall"])
    assert code == 0 and not path.exists() and "removed" in out
    code, out, err = run_cli(["worker", "service-status"])
    assert code == 3 and "not installed" in out


def test_templates_are_package_data():
    import tomllib
    from pathlib import Path

    for name in ("systemd/idlegrad-worker.service.in", "launchd/org.idlegrad.worker.plist.in"):
        assert "@EXEC@" in service.template(name) or "@ARGS@" in service.template(name)
    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert "idlegrad.packaging" in setuptools["packages"]
    data = setuptools["package-data"]["idlegrad.packaging"]
    assert {"systemd/*.in", "launchd/*.in", "Dockerfile"} <= set(data)
    assert (root / "packaging" / "Dockerfile").exists()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_unit(run_cli, tmp_path):
    _, unit = printed(run_cli, "--format", "systemd", "--coordinator", "tcp://10.0.0.5:5555",
                       "--memory-max", "512", "--max-cores", "50%", "--state-log", "/tmp/a b.log")
    target = tmp_path / "idlegrad-worker.service"
    target.write_text(unit)
    done = subprocess.run(["systemd-analyze", "verify", str(target)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    complaints = [line for line in (done.stdout + done.stderr).splitlines()
                  if "idlegrad-worker.service" in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr
    # ... and it does complain about a broken unit, so the check can fail
    target.write_text(unit.replace("Nice=19", "Nice=nineteen"))
    bad = subprocess.run(["systemd-analyze", "verify", str(target)], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert "nice priority" in bad.stdout + bad.stderr
