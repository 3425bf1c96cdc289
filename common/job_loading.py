"""Loading jobs: what to train, defined locally on every machine and named on the wire, never sent.

A job spec is a built-in name (`digits`, `synthetic`), `package.module:attr`, or
`path/to/file.py:attr`; `attr` is a callable returning a `Job`. Keyword arguments from the command
line (`--job-arg key=value`) are passed to that callable, and travel to workers in WELCOME so that
both sides build the same job.

No torch at import: the front end parses job arguments and names built-in jobs without it. The
built-in jobs' module (torch, numpy) is imported when one of them is asked for.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Any, Callable, Iterable, Optional

from .errors import JobError, ProtocolError
from .job_definition import Job
from .protocol import check_job_args

# Each is the name of its factory in common/builtin_jobs.py.
BUILTIN_JOBS = ("digits", "lm", "packed", "resnet", "synthetic")


def builtin_job_names() -> list[str]:
    return sorted(BUILTIN_JOBS)


def resolve_factory(spec: str) -> Callable[..., Job]:
    """The callable a spec names. Raises JobError with one clear line."""
    if spec in BUILTIN_JOBS:
        from . import builtin_jobs

        return getattr(builtin_jobs, spec)
    if ":" not in spec:
        raise JobError(f"unknown job {spec!r}: use a built-in ({', '.join(builtin_job_names())}), "
                       "module:attr or path/to/file.py:attr")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise JobError(f"job spec {spec!r} must look like module:attr or path/to/file.py:attr")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_file(where)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise JobError(f"cannot import job module {where!r}: {exc}") from None
        except Exception as exc:
            raise JobError(f"job module {where!r} failed to import: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise JobError(f"{where!r} has no attribute {attr!r}")
    if not callable(factory):
        raise JobError(f"{spec!r} is not callable; it must be a function returning a Job")
    return factory


def _import_file(path: str):
    if not os.path.isfile(path):
        raise JobError(f"job file {path!r} does not exist")
    name = "idlegrad_job_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise JobError(f"cannot load job file {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise JobError(f"job file {path!r} failed to import: {type(exc).__name__}: {exc}") from None
    return module


def load_job(spec: str, args: Optional[dict[str, Any]] = None) -> Job:
    factory = resolve_factory(spec)
    try:
        inspect.signature(factory).bind(**(args or {}))
    except TypeError as exc:
        raise JobError(f"job {spec!r} does not take these arguments {sorted(args or {})}: {exc}") from None
    except ValueError:
        pass  # no signature to check (a builtin): the call itself will tell
    try:
        job = factory(**(args or {}))
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"job {spec!r} failed to build: {type(exc).__name__}: {exc}") from None
    if not isinstance(job, Job):
        raise JobError(f"job {spec!r} returned {type(job).__name__}, not idlegrad.common.job.Job")
    if not isinstance(job.batch_size, int) or job.batch_size <= 0:
        raise JobError(f"job {job.name!r}: batch_size must be a positive int")
    return job


def names_a_path(value: Any) -> bool:
    """Whether a job argument's value names a file or folder (`/data`, `~/x`, `./x`, `a/b`):
    a path on the coordinator's machine, which on a worker's would name the owner's files."""
    if not isinstance(value, str) or value.startswith(("http://", "https://")):
        return False
    return (value in (".", "..", "~") or value.startswith(("~", "./", "../"))
            or "/" in value or os.sep in value or (os.altsep or "/") in value
            or os.path.isabs(value))


def local_path_args(args: dict[str, Any]) -> list[str]:
    """The names of the arguments in `args` whose values name paths."""
    return sorted(name for name, value in args.items() if names_a_path(value))


def welcome_args(args: dict[str, Any], trains_on_pack: bool) -> dict[str, Any]:
    """The job arguments workers are sent: a job that trains on a pack (its `data`, a manifest)
    has no use on a worker for the coordinator's paths it was packed from (lm's corpus), so they
    stay here. Any other path is sent, and a worker refuses it (worker/building.py)."""
    if not trains_on_pack:
        return dict(args)
    return {name: value for name, value in args.items() if not names_a_path(value)}


def parse_job_args(items: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings -> kwargs; values become int, float or bool where they read as one.

    They travel to workers in a welcome, whose bounds they are held to here: a coordinator
    started with arguments no worker would take says so at once."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise JobError(f"job argument {item!r} must look like name=value")
        out[key] = _parse_scalar(text)
    try:
        check_job_args(out, "--job-arg")
    except ProtocolError as exc:
        raise JobError(exc.detail) from None
    return out


def _parse_scalar(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if kind is float and not math.isfinite(value):
            break
        return value
    return text
