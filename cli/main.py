"""The `idlegrad` command: parsing, and dispatch to the sides.

Heavy imports (torch) happen inside the subcommands that need them, so `idlegrad --help` and the
demo's front end start instantly. Every error a user can cause ends as one line on stderr and a
non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Optional, Sequence

from .. import __version__
from ..common.errors import ConfigError, IdlegradError
from .ban import add_ban_parser
from .data import add_data_parser
from .invite import add_invite_parser
from .simulate import add_simulate_parser
from .worker_cli import add_worker_parser

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage plus a line
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind, minimum, strict: bool):
    """An argparse type: a `kind` number above (strict) or at least `minimum`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):  # nan passes no comparison; inf would wait for ever
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(
                f"{text!r} must be {'positive' if strict else 'at least ' + str(minimum)}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _positive(kind):
    return _number(kind, 0, strict=True)


def _non_negative(kind):
    return _number(kind, 0, strict=False)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="how much to log on stderr (default: info)")


def _add_job(p: argparse.ArgumentParser, required: bool) -> None:
    from ..common.job_loading import builtin_job_names

    p.add_argument("--job", required=required, metavar="SPEC",
                   help=f"a built-in job ({', '.join(builtin_job_names())}), module:attr or "
                        "path/to/file.py:attr")
    p.add_argument("--job-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the job's factory (repeatable)")


def _add_client_keys(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator-key", metavar="FILE",
                   help="CURVE: the coordinator's public key (NAME.key), pinned")
    p.add_argument("--secret-key", metavar="FILE",
                   help="CURVE: this client's NAME.key_secret; its NAME.key must be in the "
                        "coordinator's --monitor-keys, or --operator-keys to pause, drain or ban")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="idlegrad", description="Train PyTorch models on idle computers.")
    parser.add_argument("--version", action="version", version=f"idlegrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("coordinator", help="hold the model and hand out gradient tasks",
                       description="Hold the model, the optimizer and the data plan; hand out "
                                   "gradient tasks to workers and apply their results.")
    _add_job(c, required=True)
    c.add_argument("--bind", default="tcp://127.0.0.1:5555", metavar="ADDR",
                   help="ZeroMQ address to listen on (default: tcp://127.0.0.1:5555; "
                        "tcp://*:5555 for other machines)")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="save and resume here")
    c.add_argument("--checkpoint-every", type=_positive(float), default=60.0, metavar="SECONDS",
                   help="seconds between checkpoints (default: 60)")
    c.add_argument("--metrics", metavar="FILE",
                   help="JSON-lines metrics log (default: DIR/metrics.jsonl with --checkpoint-dir)")
    c.add_argument("--epochs", type=_positive(int), metavar="N", help="stop after N epochs")
    c.add_argument("--target", metavar="METRIC=VALUE",
                   help="stop when a test metric reaches VALUE, e.g. accuracy=0.95 or loss<=0.1")
    c.add_argument("--seed", type=_non_negative(int), default=0, help="model and data seed")
    c.add_argument("--heartbeat", type=_positive(float), default=1.0, metavar="SECONDS",
                   help="heartbeat interval; a worker silent for 3 beats is evicted (default: 1)")
    c.add_argument("--partitions", type=_positive(int), default=1, metavar="K",
                   help="partitions (tasks) per round (default: 1)")
    c.add_argument("--open-rounds", type=_non_negative(int), default=0, metavar="N",
                   help="rounds open at once; 0: as many as the workers ask for, at most twice what their credits hold plus two (default)")
    c.add_argument("--min-workers", type=_positive(int), default=1, metavar="N",
                   help="hand out the first slot once N workers have joined (default 1); "
                        "after that, workers come and go freely")
    c.add_argument("--staleness", choices=["inverse", "sqrt", "constant"],
                   help="step weight of a gradient tau versions old: 1/(1+tau), 1/sqrt(1+tau), 1 "
                        "(default: inverse; constant with --pipeline, whose rounds are all one "
                        "step late)")
    c.add_argument("--max-staleness", type=_non_negative(int), default=32, metavar="TAU",
                   help="gradients staler than this are replanned, not applied (default: 32)")
    c.add_argument("--delay-compensation", default="off", metavar="dc[:LAMBDA]",
                   help="correct a stale round's gradient towards the current model (DC-ASGD: "
                        "g + LAMBDA g*g (w_now - w_sent)); dc-a[:LAMBDA] divides LAMBDA by the "
                        "root of a running mean of g*g; off, dc (0.04), dc-a (2) "
                        "(default: off; docs/scaling.md has the measurements)")
    c.add_argument("--eval-every", type=_positive(float), metavar="SECONDS",
                   help="seconds between evaluations (default: adaptive, ~10%% of the time)")
    c.add_argument("--settle-on", choices=["auto", "coordinator", "workers"], default="auto",
                   help="who computes a slot to settle a suspect gradient or disagreeing "
                        "verified replicas: the coordinator, or a third worker, neither of the "
                        "disputed results' senders (the coordinator when there is none); auto: "
                        "where evaluations run (default: auto)")
    c.add_argument("--eval-on", choices=["auto", "workers", "coordinator"], default="auto",
                   help="where evaluations run: on workers (ranges of the test set as tasks), "
                        "on the coordinator, or auto: the coordinator only when one evaluation "
                        "costs it under 1%% of the run or under 20 ms (default: auto)")
    c.add_argument("--task-timeout", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="least time before a slow task is handed to another worker (default: 30)")
    c.add_argument("--pause-grace", type=_non_negative(float), default=5.0, metavar="SECONDS",
                   help="a worker paused by its owner keeps its tasks this long, then they go "
                        "to others (default: 5)")
    c.add_argument("--redundancy", default="none", metavar="CODE",
                   help="each round's code: none, replicate:R (R copies of each partition), "
                        "cyclic:S (gradient coding: any S slots may straggle) or adaptive "
                        "(chosen per round from measured task times) (default: none)")
    c.add_argument("--verify-replicas", action="store_true",
                   help="with --redundancy replicate:R, use a slot's result only once two "
                        "copies from different workers agree; if they differ, the coordinator "
                        "computes it too, and a copy that does not match is an offence (catches "
                        "wrong results of honest size, like flipped signs; a row then waits for "
                        "two copies instead of the first)")
    modes = c.add_mutually_exclusive_group()
    modes.add_argument("--sync", dest="mode", action="store_const", const="sync",
                       help="synchronous rounds: one at a time, code none, one part per ready "
                            "worker sized to its speed (DDP's updates)")
    modes.add_argument("--async", dest="mode", action="store_const", const="async",
                       help="asynchronous rounds: as many open as the workers ask for, each "
                            "gradient weighted by its staleness (with neither flag: synchronous "
                            "unless --task local, --redundancy, --verify-replicas, --partitions "
                            "above 1, --open-rounds or --delay-compensation ask for asynchronous "
                            "rounds; the status says which and why)")
    c.set_defaults(mode="auto")
    c.add_argument("--pipeline", type=_positive(int), default=1, metavar="N",
                   help="synchronous rounds open at once: a worker computes its part of the "
                        "next round while the last one is summed and stepped, whose gradient "
                        "is then applied a step late, at full weight unless --staleness says "
                        "otherwise (default: 1; docs/scaling.md has the measurements)")
    c.add_argument("--max-batch", type=_positive(int), metavar="N",
                   help="cap on a round's batch; surplus workers buy redundancy and more open "
                        "rounds (default: the job's batch size)")
    c.add_argument("--batch", default="fixed", metavar="fixed|adaptive[:MAX]",
                   help="the round batch: fixed (the job's batch size) or adaptive: grown "
                        "towards the measured gradient noise scale, never below the job's "
                        "batch, at most MAX (and --max-batch) and what the fleet computes in "
                        "10 s, at most doubled per change (default: fixed)")
    c.add_argument("--batch-lr", default="auto",
                   choices=["auto", "sqrt", "adascale", "linear", "none"],
                   help="with --batch adaptive, the learning rate of a step of B samples, "
                        "B0 the job's batch: sqrt (lr*sqrt(B/B0)), linear (lr*B/B0), adascale "
                        "(lr times AdaScale's gain from the noise estimates, within 1..B/B0) "
                        "or none; auto: adascale for SGD, sqrt for Adam and any other "
                        "optimizer. The job's schedule counts samples/B0 (default: auto)")
    c.add_argument("--no-speculate", dest="speculate", action="store_false",
                   help="do not duplicate late tasks to free workers")
    c.add_argument("--task", default="gradient", metavar="KIND",
                   help="what a slot computes: gradient (the default), local:H (H steps of the "
                        "job's optimizer, returning the parameter change: for slow links) or "
                        "local:auto (H sized per worker from its speed)")
    c.add_argument("--outer-lr", type=_positive(float), default=1.0, metavar="LR",
                   help="local tasks: the outer Nesterov SGD's learning rate (default: 1)")
    c.add_argument("--outer-momentum", type=_non_negative(float), default=0.0, metavar="M",
                   help="local tasks: the outer Nesterov momentum, below 1 (default: 0; DiLoCo "
                        "uses 0.9 with lr 0.7 for rounds of several slots, --partitions K)")
    c.add_argument("--local-slot-s", type=_positive(float), default=5.0, metavar="SECONDS",
                   help="local:auto: the least compute seconds of a slot (default: 5)")
    c.add_argument("--local-link-factor", type=_non_negative(float), default=3.0, metavar="F",
                   help="local:auto: a slot computes at least F times as long as its worker's "
                        "measured link time per slot (model down, change up), so transfers "
                        "take at most 1/(1+F) of a slot (default: 3)")
    c.add_argument("--local-max-steps", type=_positive(int), default=500, metavar="H",
                   help="local:auto: at most H inner steps per slot (default: 500)")
    c.add_argument("--result-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="how workers send results: bfloat16 halves the bytes (rounding errors "
                        "are fed back into the next result) (default: float32)")
    c.add_argument("--locality", choices=["on", "off"], default="on",
                   help="sharded training data: read each epoch shard-aware (the shards "
                        "shuffled, then the samples within windows of --shuffle-window shards) "
                        "and give workers slots of the shards they hold; off: a full shuffle. "
                        "Data that is not sharded is always fully shuffled (default: on)")
    c.add_argument("--shuffle-window", type=_positive(int), default=2, metavar="W",
                   help="with --locality on: shards whose samples are shuffled together; a "
                        "worker needs W shards at once (default: 2)")
    c.add_argument("--threads", type=_positive(int), metavar="N", help="torch threads")
    c.add_argument("--reject-norm", type=_non_negative(float), default=10.0, metavar="K",
                   help="refuse a gradient whose norm per sample is over K times the running "
                        "median of recent ones; 0: no check (default: 10)")
    c.add_argument("--ban-after", type=_non_negative(int), default=3, metavar="N",
                   help="ban a worker (its key, with keys) after N refused gradients or "
                        "malformed results within 10 minutes; 0: never (default: 3)")
    c.add_argument("--key-names", type=_positive(int), default=16, metavar="N",
                   help="worker names one key may hold at once (default: 16)")
    c.add_argument("--key-credits", type=_positive(int), default=64, metavar="N",
                   help="slots all the worker names of one key may hold at once (default: 64)")
    c.add_argument("--key-fetches", type=_positive(int), default=32, metavar="N",
                   help="blob chunk requests of one key waiting at once (default: 32)")
    c.add_argument("--key-results-per-s", type=_non_negative(float), default=1000.0,
                   metavar="R", help="results one key may send per second (bursts of twice "
                                     "as many); more are not read and their slots are dealt "
                                     "again; 0: no limit (default: 1000)")
    c.add_argument("--ledger", metavar="FILE",
                   help="append every task sent, result acknowledged and round applied as JSON "
                        "lines, across restarts (for audits and benchmarks/chaos.py)")
    c.add_argument("--secret-key", metavar="FILE",
                   help="CURVE: this coordinator's NAME.key_secret (from `idlegrad keys generate`); "
                        "with --allow-keys, traffic is encrypted and only listed keys may talk")
    c.add_argument("--allow-keys", metavar="DIR",
                   help="CURVE: directory of the NAME.key public keys of the workers allowed to "
                        "work (and only to work); re-read on SIGHUP (a removed key is cut off)")
    c.add_argument("--monitor-keys", metavar="DIR",
                   help="CURVE: directory of the NAME.key public keys that may read the status "
                        "(idlegrad status, top, credits); re-read on SIGHUP")
    c.add_argument("--operator-keys", metavar="DIR",
                   help="CURVE: directory of the NAME.key public keys that may read the status "
                        "and command: pause, resume, drain, ban, revoke and mint invitations; "
                        "re-read on SIGHUP")
    c.add_argument("--enrolled", metavar="DIR",
                   help="CURVE: enrol workers by invitation (`idlegrad invite`): the invitations "
                        "and enrolled keys live here; the enrolment endpoint listens on the "
                        "--bind port plus one")
    c.add_argument("--data", metavar="DIR",
                   help="a packed data set (the --out of `idlegrad data pack`) that the job trains "
                        "on: its manifest's hash becomes the job's `data` argument, and this "
                        "coordinator serves its shards to workers that lack them")
    c.add_argument("--blob-mirror", action="append", default=[], metavar="URL",
                   help="an http(s) mirror of --data's blobs (`idlegrad data publish`), told to "
                        "workers, which fetch from mirrors first and from the coordinator last "
                        "(repeatable)")
    c.add_argument("--snapshot-min-mb", type=_non_negative(float), default=None, metavar="MB",
                   help="a model of at least this many MB of parameters goes to workers as a "
                        "snapshot blob they fetch once per version, from a --blob-mirror first, "
                        "instead of inside tasks (default 8; 1 with --task local and a "
                        "--blob-mirror; 0: always)")
    c.add_argument("--snapshot-dir", metavar="DIR",
                   help="where the snapshot blobs are written (default: a temporary folder): "
                        "point a web server at it, or sync it to one, and name that server with "
                        "--blob-mirror so workers fetch snapshots there; snapshots no open round "
                        "needs are deleted")
    c.add_argument("--insecure", action="store_true",
                   help="without keys, listen beyond loopback anyway (anyone who reaches the port "
                        "may join)")
    _add_common(c)
    c.set_defaults(func=_run_coordinator)

    # `idlegrad worker [install|uninstall|service-status]`: settings, config file, service
    add_invite_parser(sub, _add_common, _positive)
    add_worker_parser(sub, _add_common, _positive, _non_negative, _Parser)

    d = sub.add_parser("demo", help="a coordinator and workers on this machine, training digits",
                       description="Start a coordinator and N workers on loopback, train until "
                                   "the target is reached, stop them all, and summarise.")
    d.add_argument("--workers", type=_positive(int), default=3, metavar="N",
                   help="worker processes (default: 3)")
    d.add_argument("--job", default="digits", metavar="SPEC", help="the job (default: digits)")
    d.add_argument("--job-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the job's factory (repeatable)")
    d.add_argument("--target", default="accuracy=0.95", metavar="METRIC=VALUE",
                   help="stop when reached (default: accuracy=0.95)")
    d.add_argument("--epochs", type=_positive(int), default=50, metavar="N",
                   help="stop after N epochs if the target is not reached (default: 50)")
    d.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on the last line")
    d.add_argument("--keep", metavar="DIR", help="keep checkpoint, metrics and logs in DIR")
    d.add_argument("--timeout", type=_positive(float), default=600.0, metavar="SECONDS",
                   help="give up after this long (default: 600)")
    d.add_argument("--curve", action="store_true",
                   help="encrypt and authenticate with CurveZMQ keys made for the demo, as across "
                        "machines")
    d.add_argument("--tui", action="store_true",
                   help="watch the demo in the terminal UI (`idlegrad top`) instead of a progress bar")
    _add_common(d)
    d.set_defaults(func=_run_demo)

    st = sub.add_parser("status", help="one snapshot of a coordinator: table or JSON",
                        description="Ask a coordinator for one status snapshot and print it.")
    st.add_argument("--coordinator", default="tcp://127.0.0.1:5555", metavar="ADDR",
                    help="the coordinator's address (default: tcp://127.0.0.1:5555)")
    st.add_argument("--json", action="store_true", help="print the snapshot as one JSON object")
    _add_client_keys(st)
    st.add_argument("--timeout", type=_positive(float), default=3.0, metavar="SECONDS",
                    help="give up when the coordinator does not answer this long (default: 3)")
    _add_common(st)
    st.set_defaults(func=_run_status)

    cr = sub.add_parser("credits", help="what each worker has earned: samples, compute, verified",
                        description="Per worker (per key, or worker id without keys): samples "
                                    "of applied rounds, compute seconds of used results, slots "
                                    "verified, results refused, first and last seen. Offline "
                                    "from a checkpoint, or live from a coordinator (the 100 with "
                                    "the most samples).")
    where = cr.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint-dir", metavar="DIR",
                       help="read the credits saved in this coordinator checkpoint")
    where.add_argument("--coordinator", metavar="ADDR", help="ask this running coordinator")
    cr.add_argument("--json", action="store_true",
                    help='print {"workers": {NAME: {samples, compute_s, verified, refused, '
                         'first_seen, last_seen}}} as one line')
    _add_client_keys(cr)
    cr.add_argument("--timeout", type=_positive(float), default=3.0, metavar="SECONDS",
                    help="live: give up when the coordinator does not answer this long "
                         "(default: 3)")
    _add_common(cr)
    cr.set_defaults(func=_run_credits, log_level="warning")

    t = sub.add_parser("top", help="the fleet, the curve and the events in a terminal UI",
                       description="Watch a coordinator: workers, loss and metric, rounds, events. "
                                   "Keys: q quit, s sort, / filter, p pause/resume, d drain.")
    t.add_argument("--coordinator", default="tcp://127.0.0.1:5555", metavar="ADDR",
                   help="the coordinator's address (default: tcp://127.0.0.1:5555)")
    t.add_argument("--interval", type=_positive(float), default=1.0, metavar="SECONDS",
                   help="seconds between snapshots (default: 1)")
    _add_client_keys(t)
    _add_common(t)
    t.set_defaults(func=_run_top, log_level="warning")

    add_ban_parser(sub, _add_common, _add_client_keys, _positive)

    k = sub.add_parser("keys", help="CURVE key pairs for coordinators, workers and monitors",
                       description="Manage CurveZMQ keys (pyzmq's certificate files).")
    ksub = k.add_subparsers(dest="keys_action", metavar="generate", parser_class=_Parser)
    ksub.required = True
    kg = ksub.add_parser("generate", help="write NAME.key (public) and NAME.key_secret (secret)",
                         description="Write a new key pair: NAME.key, the public key (copy it into "
                                     "the coordinator's --allow-keys directory, or give it to "
                                     "workers as --coordinator-key), and NAME.key_secret, which "
                                     "stays on this machine.")
    kg.add_argument("name", metavar="NAME", help="the files' name")
    kg.add_argument("--dir", default=".", metavar="DIR", help="where to write them (default: .)")
    _add_common(kg)
    kg.set_defaults(func=_run_keys_generate)

    add_simulate_parser(sub, _add_common, _positive, _non_negative)
    add_data_parser(sub, _add_common, _positive, _Parser)

    pl = sub.add_parser("plot", help="plot a metrics log (needs the extra: idlegrad[plot])",
                        description="Plot METRICS.jsonl: loss and metric against time and samples, "
                                    "samples/s and workers against time.")
    pl.add_argument("metrics_file", metavar="METRICS.jsonl", help="a coordinator's metrics log")
    pl.add_argument("-o", "--output", default="run.png", metavar="PNG",
                    help="image to write (default: run.png)")
    pl.add_argument("--metric", help="the test metric to plot (default: accuracy, else the first)")
    _add_common(pl)
    pl.set_defaults(func=_run_plot)
    _name_parsers(parser)
    return parser


def _name_parsers(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser in its own namespace (`_parser`), so that an unknown flag is
    reported by the subcommand it was given to, with that subcommand's --help."""
    for action in parser._actions:  # argparse keeps subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(_parser=child)
                _name_parsers(child)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")


def staleness_kind(args) -> str:
    """--staleness, by default inverse, or constant for pipelined rounds: each is one step late
    by design, and inverse weights halved every step (1.8x the samples to target, measured)."""
    return args.staleness or ("constant" if args.pipeline > 1 else "inverse")


def _run_coordinator(args) -> int:
    import os

    from .processes import check_bindable

    # a port in use: one line now, not after the job is built
    check_bindable(args.bind, "")
    if args.enrolled:
        from ..common.invitation import enrol_address

        check_bindable(enrol_address(args.bind), "the enrolment endpoint ")
    from ..common.coding import parse_redundancy
    from ..common.job_loading import parse_job_args
    from ..coordinator.budgets import BudgetConfig
    from ..coordinator.local import OuterConfig
    from ..coordinator.server import Coordinator, CoordinatorConfig
    from ..coordinator.staleness import StalenessRule
    from ..coordinator.target import Target
    from ..coordinator.trust import TrustConfig

    metrics = args.metrics
    if metrics is None and args.checkpoint_dir:
        metrics = os.path.join(args.checkpoint_dir, "metrics.jsonl")
    config = CoordinatorConfig(
        job=args.job, job_args=parse_job_args(args.job_arg), bind=args.bind,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        metrics_path=metrics, epochs=args.epochs,
        target=Target.parse(args.target) if args.target else None, seed=args.seed,
        heartbeat_s=args.heartbeat, partitions=args.partitions, open_rounds=args.open_rounds,
        pipeline=args.pipeline,
        min_workers=args.min_workers,
        staleness=StalenessRule(staleness_kind(args), args.max_staleness),
        delay_compensation=args.delay_compensation, eval_every=args.eval_every,
        eval_on=args.eval_on, settle_on=args.settle_on, min_deadline_s=args.task_timeout,
        threads=args.threads, pause_grace_s=args.pause_grace,
        redundancy=str(parse_redundancy(args.redundancy)), mode=args.mode,
        max_batch=args.max_batch, batch=args.batch, batch_lr=args.batch_lr,
        speculate=args.speculate, secret_key=args.secret_key,
        allow_keys=args.allow_keys, monitor_keys=args.monitor_keys,
        operator_keys=args.operator_keys, enrolled=args.enrolled, insecure=args.insecure,
        ledger_path=args.ledger,
        trust=_trust_config(TrustConfig, args.reject_norm, args.ban_after), task=args.task,
        budgets=BudgetConfig(names=args.key_names, credits=args.key_credits,
                             fetches=args.key_fetches, results_per_s=args.key_results_per_s,
                             results_burst=max(1.0, 2 * args.key_results_per_s)),
        outer=OuterConfig(args.outer_lr, args.outer_momentum), local_slot_s=args.local_slot_s,
        local_max_steps=args.local_max_steps, local_link_factor=args.local_link_factor,
        result_dtype=args.result_dtype, verify_replicas=args.verify_replicas,
        data_dir=args.data, blob_mirrors=tuple(args.blob_mirror),
        locality=args.locality == "on", shuffle_window=args.shuffle_window,
        snapshot_min_mb=args.snapshot_min_mb, snapshot_dir=args.snapshot_dir)
    coordinator = Coordinator(config)
    reason = coordinator.run()
    logging.getLogger("idlegrad.coordinator").info(
        "done (%s): version %d, %d samples, metrics %s", reason, coordinator.version,
        coordinator.samples_applied, coordinator.metrics)
    return EXIT_FAILED if reason == "bad target" else EXIT_OK


def _trust_config(cls, reject_norm: float, ban_after: int):
    try:
        return cls(norm_factor=reject_norm, ban_after=ban_after)
    except ValueError as exc:
        raise ConfigError(f"--reject-norm / --ban-after: {exc}") from None


def _run_status(args) -> int:
    from .status import run_status

    return run_status(args)


def _run_credits(args) -> int:
    from .credits import run_credits

    return run_credits(args)


def _run_top(args) -> int:
    from ..common.security import check_address, client_keys

    check_address(args.coordinator, "--coordinator")  # bad input: one line, before the UI
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        # A terminal UI without a terminal draws escape codes into a pipe, or waits for keys
        # that never come: one snapshot as text instead.
        print("idlegrad top: not a terminal: one snapshot instead (idlegrad status)",
              file=sys.stderr)
        args.json, args.timeout = False, max(3.0, args.interval)
        return _run_status(args)
    try:
        from ..monitor.app import run
    except ImportError as exc:
        raise ConfigError(f"the terminal UI needs textual ({exc}): pip install 'textual>=4'") from None
    keys = client_keys(args.coordinator_key, args.secret_key)
    return run(args.coordinator, interval=args.interval, keys=keys)


def _run_keys_generate(args) -> int:
    from ..common.security import generate

    public, secret = generate(args.name, args.dir)
    print(f"wrote {public} (public: for --allow-keys or --coordinator-key)")
    print(f"wrote {secret} (secret: keep it on this machine, for --secret-key)")
    return EXIT_OK


def _run_plot(args) -> int:
    from ..monitor.plot import load_metrics, plot

    records = load_metrics(args.metrics_file)  # bad input first: one line, matplotlib or not
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        print(f"idlegrad plot: error: matplotlib is not installed ({exc}): "
              "pip install 'idlegrad[plot]'", file=sys.stderr)
        return EXIT_FAILED
    out = plot(records, args.output, metric=args.metric)
    print(f"wrote {out}")
    return EXIT_OK


def _run_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ConfigError as exc:
        print(f"idlegrad {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except IdlegradError as exc:
        print(f"idlegrad {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def entry() -> None:
    """The console script: run, then leave without the interpreter's teardown when torch is
    loaded, which costs over a second per process here and holds up demos and restarts."""
    code = main()
    if "torch" in sys.modules:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
