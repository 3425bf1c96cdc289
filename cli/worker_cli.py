"""`idlegrad worker`: run a worker, or install it as a service.

    idlegrad worker [--coordinator ADDR] [settings...]          run (the settings override the file)
    idlegrad worker --print-config [settings...]                the effective settings, as TOML
    idlegrad worker join TOKEN [--install] [--config FILE]   enrol by invitation, write the file
    idlegrad worker status [--json] [settings...]           this worker's credit at each coordinator
    idlegrad worker install [--user|--system] [--print] [settings...]
    idlegrad worker uninstall [--user|--system]
    idlegrad worker service-status [--user|--system]

Settings flags have no argparse defaults: only the flags given override the configuration file
(`--config FILE`, else ~/.config/idlegrad/worker.toml), and `install` bakes exactly those into the
service's command line. No torch is imported until a worker really runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable


# (flag, setting, metavar, help); every one a setting of worker/config.py
SETTING_FLAGS: list[tuple[str, str, str, str]] = [
    ("--coordinator", "coordinator", "ADDR",
     "the coordinator's address (default: tcp://127.0.0.1:5555)"),
    ("--job", "job", "SPEC", "the job's code on this machine (default: built-in jobs only)"),
    ("--threads", "threads", "N", "torch threads (default: every core this process may use)"),
    ("--device", "device", "DEVICE", "auto, cpu or cuda[:N] (default: auto)"),
    ("--credits", "credits", "N", "tasks held at once, so the next one is ready (default: 2)"),
    ("--connect-timeout", "connect_timeout", "SECONDS",
     "give up when the coordinator cannot be reached this long (default 0: wait forever, "
     "saying so in the log every so often)"),
    ("--id", "id", "NAME", "this worker's name (default: HOST-PID)"),
    ("--state-log", "state_log", "FILE", "append every pause and resume, with readings, as JSON lines"),
    ("--coordinator-key", "coordinator_key", "FILE",
     "CURVE: the coordinator's public key (NAME.key), pinned"),
    ("--secret-key", "secret_key", "FILE",
     "CURVE: this worker's NAME.key_secret (its NAME.key goes in the coordinator's --allow-keys)"),
    ("--max-cores", "max_cores", "N|P%", "use at most N cores, or P%% of this machine's"),
    ("--memory-max", "memory_max_mb", "MB",
     "memory ceiling: pause while the worker's RSS exceeds it (a service's MemoryMax)"),
    ("--hours", "hours", "HH:MM-HH:MM",
     "compute only within these local hours (repeatable; 'any': no limit)"),
    ("--resume-after", "resume_after", "SECONDS",
     "resume only after the machine has been idle this long (default: 60)"),
    ("--sample-every", "sample_every", "SECONDS", "seconds between probe readings (default: 0.5)"),
    ("--cpu-max", "cpu_others_max_pct", "PCT|off",
     "pause when other processes use more than PCT%% of the machine (default: 25)"),
    ("--user-idle", "user_idle_min_s", "SECONDS|off",
     "pause when the user gave input within SECONDS (default: 180)"),
    ("--memory-min", "memory_available_min_mb", "MB|off",
     "pause when available memory falls below MB (default: 256)"),
    ("--gpu-max", "gpu_others_max_pct", "PCT|off",
     "pause when other processes use more than PCT%% of the GPU (default: 10)"),
    ("--pause-when-unknown", "pause_when_unknown", "RULE,...",
     "rules whose unknown readings pause: cpu,user,battery,memory,gpu,hours,rss (default: none)"),
    ("--cache-dir", "cache_dir", "DIR",
     "where data shards are cached (default: ~/.cache/idlegrad/blobs)"),
    ("--cache-max-gb", "cache_max_gb", "GB",
     "the cache's size cap; least recently used shards go first (default: 10)"),
    ("--download-max-mbps", "download_max_mbps", "MBPS|off",
     "the cache's download rate cap in megabits per second (default: off)"),
    ("--daily-transfer-max-gb", "daily_transfer_max_gb", "GB|off",
     "at most GB downloaded per UTC day (default: off)"),
    ("--blob-mirror", "blob_mirrors", "URL",
     "an http(s) mirror of data shards, tried before the coordinator's (repeatable)"),
    ("--slowdown", "slowdown", "X",
     "fault injection for tests and benchmarks: every task takes X times its compute (CPU) "
     "time (default: 1)"),
    ("--stall", "stall", "P:SECONDS",
     "fault injection for tests and benchmarks: with probability P a task stalls SECONDS "
     "(default: never)"),
    ("--poison", "poison", "scale:X|flip|nan",
     "fault injection for tests and benchmarks: send hostile gradients (times X, sign-flipped, "
     "or NaN) (default: honest)"),
    ("--link-mbps", "link_mbps", "MBPS",
     "link emulation for tests and benchmarks: throttle what this worker sends and receives to "
     "MBPS megabits per second each way (default: off)"),
]
BOOL_FLAGS: list[tuple[str, str, str]] = [
    ("--idle-policy", "enabled",
     "pause while the owner uses the machine (default: on; --no-idle-policy: always compute, "
     "within the owner's limits)"),
    ("--low-priority", "low_priority", "run at nice 19 and the idle IO class (default: on)"),
    ("--cpu-ignore-niced", "cpu_ignore_niced",
     "do not count CPU used by niced (background) processes (default: on)"),
]
FLAG_OF = {setting: flag for flag, setting, _, _ in SETTING_FLAGS}
FLAG_OF.update({setting: flag for flag, setting, _ in BOOL_FLAGS})
FLAG_OF["pause_on_battery"] = "--battery"
DEST = "setting_"  # namespace attributes: setting_<name>


def _add_settings(p: argparse.ArgumentParser, positive, non_negative) -> None:
    g = p.add_argument_group("settings (override the configuration file)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="configuration file (default: ~/.config/idlegrad/worker.toml if present)")
    types = {"threads": positive(int), "credits": positive(int),
             "connect_timeout": non_negative(float)}
    for flag, setting, metavar, help_ in SETTING_FLAGS:
        kwargs = dict(dest=DEST + setting, metavar=metavar, help=help_, default=argparse.SUPPRESS)
        if setting in types:
            kwargs["type"] = types[setting]
        if setting in ("hours", "blob_mirrors"):
            kwargs["action"] = "append"
        g.add_argument(flag, **kwargs)
    g.add_argument("--battery", dest=DEST + "pause_on_battery", choices=["pause", "run"],
                   default=argparse.SUPPRESS, help="on battery power: pause (default) or run")
    for flag, setting, help_ in BOOL_FLAGS:
        g.add_argument(flag, dest=DEST + setting, action=argparse.BooleanOptionalAction,
                       default=argparse.SUPPRESS, help=help_)


def _service_scope(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--user", dest="scope", action="store_const", const="user",
                       help="a per-user service (the default)")
    scope.add_argument("--system", dest="scope", action="store_const", const="system",
                       help="a system-wide service (needs root)")
    p.set_defaults(scope="user")


class _CoordinatorsJobArg(argparse.Action):
    """`worker --job-arg`: one line saying where job arguments come from, not "unrecognized"."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--job-arg is the coordinator's: a worker gets the job's arguments from its "
                     "coordinator (give them to `idlegrad coordinator --job-arg K=V`)")


def add_worker_parser(sub, add_common: Callable, positive: Callable, non_negative: Callable,
                      parser_class) -> argparse.ArgumentParser:
    w = sub.add_parser("worker", help="compute gradient tasks for a coordinator",
                       description="Compute gradient tasks for a coordinator, only while this "
                                   "machine is idle. Runs only job code installed on this machine; "
                                   "the coordinator only names the job.")
    _add_settings(w, positive, non_negative)
    w.add_argument("--print-config", action="store_true",
                   help="print the effective settings (TOML) and exit")
    w.add_argument("--job-arg", action=_CoordinatorsJobArg, help=argparse.SUPPRESS)
    add_common(w)
    w.set_defaults(func=run_worker)

    actions = w.add_subparsers(dest="worker_action",
                               metavar="[join|status|install|uninstall|service-status]",
                               parser_class=parser_class)
    actions.required = False
    j = actions.add_parser("join", help="join a coordinator with an invitation token",
                           description="Make this worker's key pair, enrol it with the coordinator "
                                       "using the token from `idlegrad invite`, and write the "
                                       "worker's configuration file; a bare `idlegrad worker` "
                                       "then runs with it.")
    j.add_argument("token", metavar="TOKEN", help="the last line `idlegrad invite` printed")
    j.add_argument("--config", default=None, metavar="FILE",
                   help="the configuration file to write (default: "
                        "~/.config/idlegrad/worker.toml); the keys go beside it")
    j.add_argument("--install", action="store_true",
                   help="then install and start the worker as a (user) service")
    j.add_argument("--timeout", type=positive(float), default=20.0, metavar="SECONDS",
                   help="wait this long for the coordinator's answer (default: 20)")
    add_common(j)
    j.set_defaults(func=run_join)
    st = actions.add_parser("status", help="what this worker has earned at its coordinators",
                            description="Ask each coordinator this worker serves (every "
                                        "[[project]] of its configuration) what it has earned: "
                                        "samples accepted, compute-seconds, slots verified, "
                                        "results refused, first and last seen.")
    _add_settings(st, positive, non_negative)
    st.add_argument("--json", action="store_true",
                    help='print {"projects": {NAME: {"coordinator", "worker", "credit", '
                         '"error"}}} as the last line')
    st.add_argument("--timeout", type=positive(float), default=5.0, metavar="SECONDS",
                    help="wait this long for each coordinator (default: 5)")
    add_common(st)
    st.set_defaults(func=run_status, log_level="warning")
    i = actions.add_parser("install", help="install and start the worker as a service",
                           description="Install the worker as a service (systemd on Linux, launchd "
                                       "on macOS) that starts with the machine or the login, at the "
                                       "lowest priority, with the settings given here.")
    _add_settings(i, positive, non_negative)
    _service_scope(i)
    i.add_argument("--print", dest="print_only", action="store_true",
                   help="print what would be written, write nothing")
    i.add_argument("--format", choices=["systemd", "launchd"], default=None,
                   help="service manager (default: this platform's)")
    add_common(i)
    i.set_defaults(func=run_install)
    u = actions.add_parser("uninstall", help="stop and remove the worker service")
    _service_scope(u)
    add_common(u)
    u.set_defaults(func=run_uninstall)
    s = actions.add_parser("service-status", help="is the worker service installed and running?")
    _service_scope(s)
    add_common(s)
    s.set_defaults(func=run_service_status)
    return w


def _overrides(args) -> dict:
    values = {}
    for key, value in vars(args).items():
        if key.startswith(DEST):
            name = key[len(DEST):]
            if name == "pause_on_battery":
                value = value == "pause"
            values[name] = value
    return values


def settings_of(args):
    from ..worker import config

    return config.effective(getattr(args, "config", None), _overrides(args), FLAG_OF)


def run_worker(args) -> int:
    import logging

    from ..worker import config

    settings, used = settings_of(args)
    if args.print_config:
        sys.stdout.write(config.to_toml(settings, used, config.usable_cores()))
        return 0
    log = logging.getLogger("idlegrad.worker")
    from ..common.security import client_keys

    keys = client_keys(settings.coordinator_key, settings.secret_key)  # bad files: one line
    if settings.low_priority:
        # Before torch and ZeroMQ start threads: they inherit the priority (see worker/priority.py).
        from ..worker.priority import lower_priority

        lower_priority()
    from ..common.job_loading import resolve_factory
    from ..worker.daemon import Worker, WorkerConfig

    if settings.job:
        resolve_factory(settings.job)  # an unknown job: one line now, not after joining
    base = WorkerConfig(
        coordinator=settings.coordinator, job=settings.job,
        threads=settings.threads_for(config.usable_cores()), device=settings.device,
        credits=settings.credits, connect_timeout=settings.connect_timeout,
        worker_id=settings.id, policy=settings.policy(), sample_every=settings.sample_every,
        cpu_ignore_niced=settings.cpu_ignore_niced, state_log=settings.state_log,
        slowdown=settings.slowdown,
        stall=config.parse_stall(settings.stall) if settings.stall else None,
        poison=config.parse_poison(settings.poison) if settings.poison else None, keys=keys,
        link_mbps=settings.link_mbps, cache_dir=settings.cache_dir,
        cache_max_gb=settings.cache_max_gb, download_max_mbps=settings.download_max_mbps,
        daily_transfer_max_gb=settings.daily_transfer_max_gb, blob_mirrors=settings.blob_mirrors)
    if settings.projects:
        worker = _multi_worker(settings, base)
    else:
        worker = Worker(base)  # an unusable device: one line
    if settings.low_priority:
        from ..worker.priority import current_priority

        log.info("running at low priority: %s", current_priority())
    reason = worker.run()
    log.info("stopped (%s) after %d results, %d pauses", reason, worker.results_sent, worker.pauses)
    return 0


def _multi_worker(settings, base):
    """The [[project]]s of the configuration: one worker serving each coordinator by share."""
    from ..common.job_loading import resolve_factory
    from ..common.security import client_keys
    from ..worker.projects import MultiWorker, ProjectConfig

    projects = []
    for project in settings.projects:
        if project.job:
            resolve_factory(project.job)  # an unknown job: one line now
        projects.append(ProjectConfig(
            name=project.label, coordinator=project.coordinator, share=project.share,
            job=project.job, credits=project.credits or settings.credits,
            keys=client_keys(project.coordinator_key, project.secret_key)))
    return MultiWorker(base, projects)


def _run_args(args) -> list[str]:
    """The worker's command-line flags that `install` bakes into the service."""
    out: list[str] = []
    if getattr(args, "config", None):
        out += ["--config", os.path.abspath(args.config)]
    for name, value in _overrides(args).items():
        flag = FLAG_OF[name]
        if name == "pause_on_battery":
            out += [flag, "pause" if value else "run"]
        elif name in ("low_priority", "cpu_ignore_niced", "enabled"):
            out.append(flag if value else "--no-" + flag[2:])
        elif name == "hours":
            for span in value:
                out += [flag, span]
        elif name in ("state_log", "coordinator_key", "secret_key"):
            out += [flag, os.path.abspath(value)]
        else:
            out += [flag, str(value)]
    return out


def run_install(args) -> int:
    from ..worker import service

    settings, _ = settings_of(args)  # validates before anything is written
    fmt = args.format or service.platform_format()
    text, path = service.render(fmt, args.scope, _run_args(args), settings)
    if args.print_only:
        sys.stdout.write(f"# {path}\n" + text)
        return 0
    for line in service.install(fmt, args.scope, text, path):
        print(line)
    return 0


def run_join(args) -> int:
    from ..worker import config, join

    path = join.default_config(args.config)
    for line in join.join(args.token, path, args.timeout):
        print(line)
    if args.install:
        from ..worker import service

        settings, _ = config.effective(path, {}, FLAG_OF)
        fmt = service.platform_format()
        text, unit = service.render(fmt, "user", ["--config", os.path.abspath(path)], settings)
        for line in service.install(fmt, "user", text, unit):
            print(line)
    return 0


def run_status(args) -> int:
    from .worker_status import run_worker_status

    settings, _ = settings_of(args)
    return run_worker_status(settings, args.json, args.timeout)


def run_uninstall(args) -> int:
    from ..worker import service

    for line in service.uninstall(service.platform_format(), args.scope):
        print(line)
    return 0


def run_service_status(args) -> int:
    from ..worker import service

    code, text = service.status(service.platform_format(), args.scope)
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
    return code
