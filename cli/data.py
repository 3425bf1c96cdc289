"""`idlegrad data pack` and `idlegrad data publish`: data sets into content-addressed shards, and
shards into the folder a static HTTP mirror serves (common/blobs.py)."""

from __future__ import annotations

import os

from ..common.blobs import DEFAULT_SHARD_MB, DataError


def add_data_parser(sub, add_common, positive, parser_class) -> None:
    d = sub.add_parser("data", help="pack data sets into shards; publish them for mirrors",
                       description="Content-addressed data: a manifest names shards by sha256.")
    dsub = d.add_subparsers(dest="data_action", metavar="pack|publish", parser_class=parser_class)
    dsub.required = True
    p = dsub.add_parser(
        "pack", help="turn a data set into shards plus a manifest",
        description="SOURCE is a folder of text files (with --window N: samples are windows of N "
                    "bytes), a .npz holding inputs and targets, an inputs .npy (with --targets), "
                    "or, with --job, the job's training set (SOURCE left out). Writes "
                    "DIR/manifest.json and DIR/blobs/; prints the manifest's sha256.")
    p.add_argument("source", nargs="?", metavar="SOURCE", help="folder, .npz or .npy")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the pack")
    p.add_argument("--shard-mb", type=positive(float), default=DEFAULT_SHARD_MB, metavar="MB",
                   help=f"about this many MiB per shard (default: {DEFAULT_SHARD_MB:g})")
    p.add_argument("--window", type=positive(int), metavar="N",
                   help="a folder of text: bytes per sample (byte-level tokens)")
    p.add_argument("--targets", metavar="FILE.npy", help="an inputs .npy: its targets")
    p.add_argument("--job", metavar="SPEC", help="pack this job's training set")
    p.add_argument("--job-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the job's factory (repeatable)")
    add_common(p)
    p.set_defaults(func=run_pack, log_level="warning")
    u = dsub.add_parser(
        "publish", help="lay out a pack as a mirror's blob folder",
        description="Copy DIR's manifest and shards, each checked against its name, into "
                    "FOLDER/blobs/<sha256[:2]>/<sha256>: serve FOLDER with any static HTTP "
                    "server. One FOLDER may hold many packs.")
    u.add_argument("pack_dir", metavar="DIR", help="the --out of idlegrad data pack")
    u.add_argument("--to", required=True, metavar="FOLDER", help="the mirror's folder")
    add_common(u)
    u.set_defaults(func=run_publish, log_level="warning")


def run_pack(args) -> int:
    try:
        return _pack(args)
    except OSError as exc:  # an --out that is a file, a read-only folder: one line
        raise DataError(f"{exc.filename or args.out}: {exc.strerror or exc}") from None


def _pack(args) -> int:
    from ..common import blobs

    given = [bool(args.source), bool(args.job)]
    if given.count(True) != 1:
        raise DataError("give SOURCE or --job SPEC (one of them)")
    if args.job:
        from ..common.job import load_job, parse_job_args

        job = load_job(args.job, parse_job_args(args.job_arg))
        train, _ = job.build_datasets()
        manifest = blobs.pack_dataset(train, args.out, args.shard_mb, f"job {job.name!r}'s train set")
    elif os.path.isdir(args.source):
        if args.window is None:
            raise DataError(f"{args.source} is a folder: give --window N (bytes per sample)")
        manifest = blobs.pack_corpus(args.source, args.out, args.window, args.shard_mb)
    elif args.source.endswith((".npz", ".npy")):
        inputs, targets = blobs.load_numpy_pair(args.source, args.targets)
        manifest = blobs.pack_arrays(inputs, targets, args.out, args.shard_mb, args.source)
    elif not os.path.exists(args.source):
        raise DataError(f"{args.source}: no such file or folder")
    else:
        raise DataError(f"{args.source}: not a folder, .npz or .npy")
    print(f"{manifest.sha256}  {args.out}/manifest.json: {manifest.samples} samples in "
          f"{len(manifest.shards)} shard{'s' if len(manifest.shards) != 1 else ''} of "
          f"{manifest.shards[0].samples} samples")
    return 0


def run_publish(args) -> int:
    from ..common.blobs import publish

    try:
        manifest, copied, present = publish(args.pack_dir, args.to)
    except OSError as exc:
        raise DataError(f"{exc.filename or args.to}: {exc.strerror or exc}") from None
    print(f"{manifest.sha256}  published to {args.to}: {copied} blobs copied, {present} already there")
    return 0
