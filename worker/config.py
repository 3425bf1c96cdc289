"""The worker's settings: a TOML file, then command-line flags over it, validated in one place.

The file is `--config FILE`, or else `$XDG_CONFIG_HOME/idlegrad/worker.toml` (by default
`~/.config/idlegrad/worker.toml`) when it exists. Every key is optional; `idlegrad worker
--print-config` prints the effective settings in this same format. A limit written as `false`
switches its rule off. An invalid value is one `ConfigError` line naming the key.

No torch here: printing the configuration or a service unit starts instantly.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from ..common.errors import ConfigError
from ..common.errors import ProtocolError
from ..common.protocol import MAX_WORKER_ID, check_blob_mirror
from ..common.security import check_address
from .idle import RULES, PolicyConfig, parse_hours

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class Project:
    """One `[[project]]` table: a coordinator this worker serves, for `share` of its time."""
    coordinator: str
    share: float = 1.0
    name: Optional[str] = None  # in logs and reports; default: the coordinator's address
    job: Optional[str] = None
    credits: Optional[int] = None  # None: the top-level credits
    coordinator_key: Optional[str] = None
    secret_key: Optional[str] = None

    @property
    def label(self) -> str:
        return self.name or self.coordinator


PROJECT_KEYS = ("name", "coordinator", "share", "job", "credits", "coordinator_key", "secret_key")
# Top-level keys that belong to each project once [[project]]s are listed.
PER_PROJECT = ("coordinator", "job", "coordinator_key", "secret_key")


@dataclass(frozen=True)
class Settings:
    # [top level] where and what
    coordinator: str = "tcp://127.0.0.1:5555"
    job: Optional[str] = None
    device: str = "auto"
    credits: int = 2
    connect_timeout: float = 0.0  # 0: wait for the coordinator forever
    id: Optional[str] = None
    state_log: Optional[str] = None
    coordinator_key: Optional[str] = None  # CURVE: the coordinator's NAME.key
    secret_key: Optional[str] = None  # CURVE: this worker's NAME.key_secret
    # [limits] the owner's
    threads: Optional[int] = None
    max_cores: Optional[str] = None  # "N" cores or "P%" of this machine's
    memory_max_mb: Optional[float] = None  # the worker's RSS ceiling (and MemoryMax= of a service)
    hours: tuple[str, ...] = ()  # allowed local times, "22:00-07:00"; none: any time
    low_priority: bool = True  # nice 19 and the idle IO class
    # [idle] the rules
    enabled: bool = True  # false: compute whatever the machine does (the owner's limits still hold)
    resume_after: float = 60.0
    sample_every: float = 0.5
    cpu_others_max_pct: Optional[float] = 25.0
    cpu_ignore_niced: bool = True
    user_idle_min_s: Optional[float] = 180.0
    pause_on_battery: bool = True
    memory_available_min_mb: Optional[float] = 256.0
    gpu_others_max_pct: Optional[float] = 10.0
    pause_when_unknown: tuple[str, ...] = ()
    # [cache] data shards and manifests fetched for jobs that declare their data (worker/cache.py)
    cache_dir: Optional[str] = None  # default $XDG_CACHE_HOME/idlegrad/blobs
    cache_max_gb: float = 10.0  # least recently used blobs go first beyond this
    download_max_mbps: Optional[float] = None  # the owner's cap on the cache's download rate
    daily_transfer_max_gb: Optional[float] = None  # per UTC day, kept across restarts
    blob_mirrors: tuple[str, ...] = ()  # http(s) mirrors (idlegrad data publish), tried first
    # fault injection, for tests and benchmarks only (off by default)
    slowdown: float = 1.0  # every task lasts this many times its CPU time
    stall: Optional[str] = None  # "P:SECONDS": with probability P a task stalls that long
    poison: Optional[str] = None  # "scale:X", "flip" or "nan": a hostile worker's gradients
    link_mbps: Optional[float] = None  # emulate a link of this many Mbit/s each way (link.py)
    # [[project]] tables: several coordinators by share; none: the one `coordinator` above
    projects: tuple[Project, ...] = ()

    def policy(self, uses_gpu: bool = False) -> PolicyConfig:
        on = self.enabled
        return PolicyConfig(
            resume_after=self.resume_after,
            cpu_others_max_pct=self.cpu_others_max_pct if on else None,
            user_idle_min_s=self.user_idle_min_s if on else None,
            pause_on_battery=self.pause_on_battery and on,
            memory_available_min_mb=self.memory_available_min_mb if on else None,
            gpu_others_max_pct=self.gpu_others_max_pct if on else None, uses_gpu=uses_gpu,
            hours=tuple(parse_hours(h) for h in self.hours),
            worker_rss_max_mb=self.memory_max_mb,
            pause_when_unknown=frozenset(self.pause_when_unknown) if on else frozenset())

    def threads_for(self, usable: int) -> int:
        """torch threads: --threads (default every usable core), capped by max_cores."""
        threads = self.threads or usable
        cap = resolve_cores(self.max_cores, usable)
        return max(1, min(threads, cap)) if cap is not None else threads


SECTIONS: dict[str, tuple[str, ...]] = {
    "": ("coordinator", "job", "device", "credits", "connect_timeout", "id", "state_log",
         "coordinator_key", "secret_key"),
    "limits": ("threads", "max_cores", "memory_max_mb", "hours", "low_priority"),
    "idle": ("enabled", "resume_after", "sample_every", "cpu_others_max_pct", "cpu_ignore_niced",
             "user_idle_min_s", "pause_on_battery", "memory_available_min_mb",
             "gpu_others_max_pct", "pause_when_unknown"),
    "cache": ("cache_dir", "cache_max_gb", "download_max_mbps", "daily_transfer_max_gb",
              "blob_mirrors"),
    "faults": ("slowdown", "stall", "poison", "link_mbps"),
}
KEY_OF = {name: (f"{section}.{name}" if section else name)
          for section, names in SECTIONS.items() for name in names}
OFF_ABLE = {"cpu_others_max_pct", "user_idle_min_s", "memory_available_min_mb",
            "gpu_others_max_pct", "memory_max_mb", "download_max_mbps", "daily_transfer_max_gb"}
DEVICES_HELP = "auto, cpu or cuda[:N]"


def parse_stall(text: str) -> tuple[float, float]:
    """'P:SECONDS' -> (probability, seconds), 0 <= P <= 1, SECONDS >= 0."""
    p, sep, seconds = str(text).strip().partition(":")
    try:
        prob, wait = float(p), float(seconds)
    except ValueError:
        prob = wait = float("nan")
    if not sep or not 0 <= prob <= 1 or not wait >= 0 or wait == float("inf"):
        raise ValueError(f"{text!r} must be P:SECONDS with 0 <= P <= 1, e.g. 0.2:3")
    return prob, wait




def parse_poison(text: str) -> tuple[str, float]:
    """'scale:X' (gradients times X), 'flip' (sign flipped) or 'nan' -> (kind, factor)."""
    kind, sep, factor = str(text).strip().partition(":")
    if kind == "scale" and sep:
        try:
            value = float(factor)
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return kind, value
    elif kind in ("flip", "nan") and not sep:
        return kind, -1.0 if kind == "flip" else math.nan
    raise ValueError(f"{text!r} must be scale:X, flip or nan")


def default_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "idlegrad", "worker.toml")


def resolve_cores(spec: Optional[str], usable: int) -> Optional[int]:
    """'3' -> 3 (at most `usable`), '50%' -> half of `usable` (at least 1); None -> None."""
    if spec is None:
        return None
    text = str(spec).strip()
    if text.endswith("%"):
        pct = float(text[:-1])
        return max(1, math.floor(usable * pct / 100.0))
    return max(1, min(usable, int(text)))


# validation --------------------------------------------------------------------------------------


def _fail(where: str, key: str, problem: str) -> ConfigError:
    name = KEY_OF.get(key, key)
    if where == "--" + name.replace("_", "-"):  # the flag already names the key
        return ConfigError(f"{where}: {problem}")
    return ConfigError(f"{where}: {name}: {problem}")


def _number(value, where, key, *, integer=False, minimum=0.0, strict=False, upper=None,
            off=False):
    if value is False and off:
        return None
    if isinstance(value, str):  # from a flag
        text = value.strip()
        if off and text.lower() in ("off", "false", "none"):
            return None
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise _fail(where, key, f"{value!r} is not a number"
                        + (" (or off)" if off else "")) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and not isinstance(value, int)) or not math.isfinite(value):
        kind = "an integer" if integer else "a number"
        raise _fail(where, key, f"must be {kind}{' or false' if off else ''}, got {value!r}")
    if value < minimum or (strict and value == minimum) or (upper is not None and value > upper):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        if upper is not None:
            bound += f" and <= {upper:g}"
        raise _fail(where, key, f"must be {bound}, got {value!r}")
    return value


def _bool(value, where, key):
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
    if not isinstance(value, bool):
        raise _fail(where, key, f"must be true or false, got {value!r}")
    return value


def _string(value, where, key, optional=True):
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, key, f"must be a non-empty string, got {value!r}")
    return value


def _cores(value, where, key):
    text = str(value).strip() if not isinstance(value, bool) else "?"
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not (0 < pct <= 100):
                raise ValueError
        else:
            if int(text) < 1:
                raise ValueError
    except ValueError:
        raise _fail(where, key, f"must be a number of cores >= 1 or a percentage like '50%', "
                                f"got {value!r}") from None
    return text


def _str_list(value, where, key):
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _fail(where, key, f"must be a list of strings, got {value!r}")
    return tuple(value)


def _check(name: str, value: Any, where: str) -> Any:
    n = lambda **kw: _number(value, where, name, **kw)  # noqa: E731
    if name == "coordinator":
        value = _string(value, where, name, optional=False)
        try:
            return check_address(value, repr(value))
        except ConfigError as exc:
            raise _fail(where, name, str(exc).removeprefix(f"{value!r} ")) from None
    if name == "id":
        value = _string(value, where, name)
        if value is not None and len(value) > MAX_WORKER_ID:
            raise _fail(where, name, f"at most {MAX_WORKER_ID} characters (the coordinator "
                                     f"refuses longer ids), got {len(value)}")
        return value
    if name in ("job", "state_log", "coordinator_key", "secret_key", "cache_dir"):
        return _string(value, where, name)
    if name == "device":
        value = _string(value, where, name, optional=False)
        if value != "auto" and value != "cpu" and not value.startswith("cuda"):
            raise _fail(where, name, f"{value!r} unknown: use {DEVICES_HELP}")
        return value
    if name == "credits":
        return n(integer=True, minimum=1)
    if name == "connect_timeout":
        return n()
    if name == "threads":
        return None if value is None else n(integer=True, minimum=1)
    if name == "max_cores":
        return None if value is None else _cores(value, where, name)
    if name in ("resume_after",):
        return n()
    if name == "sample_every":
        return n(minimum=0.05)
    if name in ("cpu_others_max_pct", "gpu_others_max_pct"):
        return n(upper=100, off=True)
    if name in ("user_idle_min_s", "memory_available_min_mb"):
        return n(off=True)
    if name == "memory_max_mb":
        return n(strict=True, off=True)
    if name in ("low_priority", "cpu_ignore_niced", "pause_on_battery", "enabled"):
        return _bool(value, where, name)
    if name == "hours":
        spans = _str_list(value, where, name)
        if [s.strip().lower() for s in spans] in (["any"], ["always"]):
            return ()
        for span in spans:
            try:
                parse_hours(span)
            except ValueError as exc:
                raise _fail(where, name, str(exc)) from None
        return tuple(s.strip() for s in spans)
    if name == "cache_max_gb":
        return n(strict=True)
    if name in ("download_max_mbps", "daily_transfer_max_gb"):
        return None if value is None else n(strict=True, off=True)
    if name == "blob_mirrors":
        mirrors = tuple(m.strip() for m in _str_list(value, where, name))
        for mirror in mirrors:
            try:
                check_blob_mirror(mirror, repr(mirror))
            except ProtocolError as exc:
                raise _fail(where, name, exc.detail.removeprefix(f"{mirror!r}: ")) from None
        return mirrors
    if name == "slowdown":
        return n(minimum=1.0)
    if name == "link_mbps":
        return None if value is None else n(strict=True, off=True)
    if name == "stall":
        if value is None:
            return None
        try:
            parse_stall(str(value))
        except ValueError as exc:
            raise _fail(where, name, str(exc)) from None
        return str(value).strip()
    if name == "poison":
        if value is None:
            return None
        try:
            parse_poison(str(value))
        except ValueError as exc:
            raise _fail(where, name, str(exc)) from None
        return str(value).strip()
    if name == "pause_when_unknown":
        rules = tuple(r.strip() for r in _str_list(value, where, name))
        bad = [r for r in rules if r not in RULES]
        if bad:
            raise _fail(where, name, f"unknown rules {bad}; the rules are {', '.join(RULES)}")
        return rules
    raise _fail(where, name, "unknown key")  # pragma: no cover - names come from SECTIONS


def _projects(tables, where: str) -> tuple[Project, ...]:
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{where}: project must be [[project]] tables (each with a coordinator)")
    projects = []
    for i, table in enumerate(tables, 1):
        at = f"{where}: [[project]] {i}"
        unknown = sorted(set(table) - set(PROJECT_KEYS))
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]}; a [[project]] has "
                              f"{', '.join(PROJECT_KEYS)}")
        if "coordinator" not in table:
            raise ConfigError(f"{at}: coordinator: missing (every [[project]] names its coordinator)")
        values = {key: _check(key, value, at) for key, value in table.items()
                  if key not in ("share", "name")}
        if "share" in table:
            values["share"] = _number(table["share"], at, "share", strict=True)
        if "name" in table:
            values["name"] = _string(table["name"], at, "name", optional=False)
        projects.append(Project(**values))
    labels = [p.label for p in projects]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ConfigError(f"{where}: [[project]]s must differ in name (or coordinator): {twice[0]} "
                          f"is listed {labels.count(twice[0])} times")
    return tuple(projects)


def from_toml_text(text: str, where: str, base: Settings = Settings()) -> Settings:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and key:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{key}] must be a table")
            for sub, subvalue in value.items():
                if sub not in SECTIONS[key]:
                    raise ConfigError(f"{where}: unknown key {key}.{sub!s}; "
                                      f"[{key}] has {', '.join(SECTIONS[key])}")
                values[sub] = _check(sub, subvalue, where)
        elif key in SECTIONS[""]:
            values[key] = _check(key, value, where)
        elif key == "project":
            values["projects"] = _projects(value, where)
        else:
            raise ConfigError(f"{where}: unknown key {key!s} (see idlegrad worker --print-config)")
    if "projects" in values:
        clash = [key for key in PER_PROJECT if key in data]
        if clash:
            raise ConfigError(f"{where}: {clash[0]}: set it in each [[project]], not at the top "
                              "level, when [[project]]s are listed")
    return replace(base, **values)


def load(path: Optional[str]) -> tuple[Settings, Optional[str]]:
    """Settings from `path` (must exist) or the default file (if it exists); and the file used."""
    explicit = path is not None
    path = path or default_path()
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"--config: {path}: no such file") from None
        return Settings(), None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return from_toml_text(text, os.path.basename(path) if not explicit else path), path


def with_overrides(settings: Settings, overrides: dict[str, Any], flags: dict[str, str]) -> Settings:
    """Apply flag values (`overrides`: setting name -> raw value); `flags` names each one's flag
    for error messages."""
    values = {}
    for name, value in overrides.items():
        values[name] = _check(name, value, flags.get(name, name))
    return replace(settings, **values)


def effective(config_path: Optional[str], overrides: dict[str, Any],
              flags: dict[str, str]) -> tuple[Settings, Optional[str]]:
    settings, used = load(config_path)
    if settings.projects:
        clash = [name for name in PER_PROJECT if name in overrides]
        if clash:
            raise ConfigError(f"{flags.get(clash[0], clash[0])}: {used} lists [[project]]s; "
                              f"set {clash[0]} in each [[project]] there instead")
    settings = with_overrides(settings, overrides, flags)
    try:
        settings.policy()
    except ValueError as exc:  # a combination no single key check can see
        raise ConfigError(f"idle policy: {exc}") from None
    return settings, used


# printing ----------------------------------------------------------------------------------------


def _toml_value(value) -> str:
    if value is None:
        return "false"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(value)  # pragma: no cover


def to_toml(settings: Settings, source: Optional[str] = None, usable_cores: Optional[int] = None) -> str:
    lines = ["# idlegrad worker: effective settings "
             + (f"(from {source} and the command line)" if source else "(defaults and the command line)")]
    for section, names in SECTIONS.items():
        if section:
            lines += ["", f"[{section}]"]
        for name in names:
            value = getattr(settings, name)
            if settings.projects and name in PER_PROJECT:
                lines.append(f"# {name}: in each [[project]] below")
                continue
            if value is None and name not in OFF_ABLE:
                lines.append(f"# {name} = (not set)")
                continue
            line = f"{name} = {_toml_value(value)}"
            if name == "max_cores" and usable_cores is not None:
                line += f"  # {settings.threads_for(usable_cores)} threads on this machine"
            lines.append(line)
    for project in settings.projects:
        lines += ["", "[[project]]"]
        for name in PROJECT_KEYS:
            value = getattr(project, name)
            lines.append(f"# {name} = (not set)" if value is None
                         else f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def settings_names() -> list[str]:
    return [f.name for f in fields(Settings)]


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
