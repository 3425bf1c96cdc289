"""Installing the worker as a service: a systemd unit (Linux) or a launchd agent (macOS).

The unit is rendered from the templates in `packaging/` (shipped in the wheel as the package data
of `idlegrad.packaging`). It runs this same Python (`sys.executable -m idlegrad.cli worker`) with
the settings flags given to `install`, `--connect-timeout 0` (a service waits for its coordinator
forever), at the lowest priority, restarted on failure. No torch here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Optional
from xml.sax.saxutils import escape

from ..common import atomic
from ..common.errors import ConfigError, IdlegradError
from .config import Settings, resolve_cores, usable_cores

UNIT = "idlegrad-worker.service"
LABEL = "org.idlegrad.worker"


def platform_format() -> str:
    if sys.platform == "darwin":
        return "launchd"
    if sys.platform.startswith("linux"):
        return "systemd"
    raise ConfigError(f"no service support on {sys.platform}: start `idlegrad worker "
                      "--connect-timeout 0` from the system's own startup instead")


def template(name: str) -> str:
    """A template from packaging/: package data of `idlegrad.packaging` in an installed wheel (a
    data-only directory, no __init__.py, so a checkout's `packaging/` never shadows the PyPI
    library of that name); in a source checkout or an editable install, the folder itself."""
    try:
        return resources.files("idlegrad.packaging").joinpath(name).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        checkout = Path(__file__).resolve().parents[1] / "packaging" / name
        return checkout.read_text(encoding="utf-8")


def unit_path(fmt: str, scope: str) -> str:
    home = os.path.expanduser("~")
    if fmt == "systemd":
        if scope == "system":
            return f"/etc/systemd/system/{UNIT}"
        base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
        return os.path.join(base, "systemd", "user", UNIT)
    if scope == "system":
        return f"/Library/LaunchDaemons/{LABEL}.plist"
    return os.path.join(home, "Library", "LaunchAgents", f"{LABEL}.plist")


def worker_command(run_args: list[str]) -> list[str]:
    args, skip = [], False
    for a in run_args:  # the service's own --connect-timeout wins
        if skip:
            skip = False
            continue
        if a == "--connect-timeout":
            skip = True
            continue
        args.append(a)
    return [sys.executable, "-m", "idlegrad.cli", "worker", *args, "--connect-timeout", "0"]


def systemd_quote(arg: str) -> str:
    """One word of a systemd ExecStart= line: specifiers (%) and variables ($) escaped."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in ' \t"\'\\;'):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(fmt: str, scope: str, run_args: list[str], settings: Settings) -> tuple[str, str]:
    """(the file's text, where it goes)."""
    command = worker_command(run_args)
    path = unit_path(fmt, scope)
    if fmt == "systemd":
        if settings.memory_max_mb is not None:
            memory = f"MemoryMax={max(1, int(settings.memory_max_mb))}M"
        else:
            memory = "# MemoryMax= unset: install with --memory-max MB to cap the worker's memory"
        cores = resolve_cores(settings.max_cores, usable_cores())
        quota = (f"CPUQuota={cores * 100}%" if cores is not None
                 else "# CPUQuota= unset: --max-cores N|P% caps the cores")
        system = ("# A transient unprivileged user; the Python environment must be readable by "
                  "all.\nDynamicUser=yes\nStateDirectory=idlegrad\n"
                  "Environment=HOME=/var/lib/idlegrad" if scope == "system"
                  else "# A user service: `loginctl enable-linger $USER` keeps it running "
                       "without a login.")
        text = (template("systemd/idlegrad-worker.service.in")
                .replace("@EXEC@", " ".join(systemd_quote(a) for a in command))
                .replace("@MEMORY@", memory).replace("@CPUQUOTA@", quota)
                .replace("@SYSTEM@", system)
                .replace("@WANTED_BY@", "multi-user.target" if scope == "system" else "default.target"))
        return text, path
    if fmt == "launchd":
        log = ("/Library/Logs/idlegrad-worker.log" if scope == "system"
               else os.path.join(os.path.expanduser("~"), "Library", "Logs", "idlegrad-worker.log"))
        args = "\n".join(f"        <string>{escape(a)}</string>" for a in command)
        text = (template("launchd/org.idlegrad.worker.plist.in")
                .replace("@LABEL@", LABEL).replace("@ARGS@", args).replace("@LOG@", escape(log)))
        return text, path
    raise ConfigError(f"unknown service format {fmt!r}: systemd or launchd")


def _run(cmd: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(cmd)}: timed out"
    return done.returncode, (done.stdout + done.stderr).strip()


def _manager(fmt: str, scope: str, *args: str) -> list[str]:
    if fmt == "systemd":
        return ["systemctl", *(["--user"] if scope == "user" else []), *args]
    return ["launchctl", *args]


def install(fmt: str, scope: str, text: str, path: str) -> list[str]:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic.write_text(path, text)
    except OSError as exc:
        hint = " (a --system service needs root)" if scope == "system" else ""
        raise IdlegradError(f"cannot write {path}: {exc.strerror or exc}{hint}") from None
    lines = [f"wrote {path}"]
    if fmt == "systemd":
        steps = [_manager(fmt, scope, "daemon-reload"), _manager(fmt, scope, "enable", "--now", UNIT)]
    else:
        steps = [_manager(fmt, scope, "load", "-w", path)]
    for cmd in steps:
        code, out = _run(cmd)
        if code != 0:
            first = out.splitlines()[0] if out else f"exit {code}"
            raise IdlegradError(f"wrote {path}, but `{' '.join(cmd)}` failed: {first}; start the "
                                f"service once the service manager runs: {' '.join(steps[-1])}")
        lines.append(f"ran: {' '.join(cmd)}")
    if fmt == "systemd" and scope == "user":
        lines.append("to keep it running while you are logged out: loginctl enable-linger $USER")
    return lines


def uninstall(fmt: str, scope: str) -> list[str]:
    path = unit_path(fmt, scope)
    lines = []
    stop = (_manager(fmt, scope, "disable", "--now", UNIT) if fmt == "systemd"
            else _manager(fmt, scope, "unload", "-w", path))
    code, out = _run(stop)
    lines.append(f"ran: {' '.join(stop)}" + ("" if code == 0 else f" (failed: {out.splitlines()[0] if out else code})"))
    if os.path.exists(path):
        try:
            os.remove(path)
        except OSError as exc:
            raise IdlegradError(f"cannot remove {path}: {exc.strerror or exc}") from None
        lines.append(f"removed {path}")
    else:
        lines.append(f"no {path}: nothing to remove")
    if fmt == "systemd":
        _run(_manager(fmt, scope, "daemon-reload"))
    return lines


def status(fmt: str, scope: str) -> tuple[int, str]:
    path = unit_path(fmt, scope)
    if not os.path.exists(path):
        return 3, f"idlegrad worker service: not installed (no {path})"
    cmd = (_manager(fmt, scope, "status", UNIT, "--no-pager") if fmt == "systemd"
           else _manager(fmt, scope, "list", LABEL))
    code, out = _run(cmd)
    return code, f"idlegrad worker service: installed at {path}\n{out}"


def verify_available() -> Optional[str]:
    return shutil.which("systemd-analyze")
