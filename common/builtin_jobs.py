"""Jobs that ship with idlegrad: `digits` (a real data set), `synthetic` (sized for benchmarks)
and `packed` (a classifier over packed arrays, fetched by manifest).

digits and synthetic build their data without any download, identically on every machine: digits
from the CSV that scikit-learn ships, synthetic from numpy's legacy RandomState, whose stream is
frozen. packed reads shards named by their sha256, so every machine reads the same bytes.
A built-in job's name (common/job_loading.py's BUILTIN_JOBS) is its factory's name here.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib.util
import math
import os
import shutil
import tempfile
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .errors import JobError
from .job_definition import Job


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def mlp(sizes: list[int], batch_norm: bool = False, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers with ReLU between them; with `batch_norm`, a BatchNorm1d before each ReLU;
    with `dropout` > 0, a Dropout of that probability after each."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            if batch_norm:
                layers.append(nn.BatchNorm1d(b))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def no_decay(name: str, parameter: nn.Parameter) -> bool:
    """Biases and normalisation weights (one-dimensional parameters) take no weight decay."""
    return parameter.dim() <= 1


def adam(lr: float, weight_decay: float):
    """An optimizer factory: Adam, or with `weight_decay` AdamW whose groups leave biases and
    norms undecayed (it takes named parameters: common/job.py's make_optimizer); fused (`fused`)."""
    if not weight_decay:
        return lambda params: fused(torch.optim.Adam, params, lr=lr)

    def build_optimizer(named_parameters):
        decayed = [p for n, p in named_parameters if not no_decay(n, p)]
        undecayed = [p for n, p in named_parameters if no_decay(n, p)]
        return adamw([{"params": decayed, "weight_decay": weight_decay},
                      {"params": undecayed, "weight_decay": 0.0}], lr=lr)
    return build_optimizer


def adamw(groups, **settings) -> torch.optim.AdamW:
    """AdamW, fused (`fused`)."""
    return fused(torch.optim.AdamW, groups, **settings)


def fused(optimizer, params, **settings) -> torch.optim.Optimizer:
    """`optimizer` (Adam, AdamW) fused where torch has a kernel for the parameters' device (CPU
    from torch 2.4, and CUDA): one pass over all parameters instead of several per parameter,
    which is most of the coordinator's step, between one round and the next (8 ms against
    2.4 ms for lm tiny; 1.2 ms against 0.26 ms for the 300,000 parameters of digits at
    hidden=4096)."""
    params = list(params)  # read twice when the fused one is refused
    try:
        return optimizer(params, fused=True, **settings)
    except (RuntimeError, TypeError, ValueError):  # an older torch, or a device without one
        return optimizer(params, **settings)


def warmup_cosine(warmup: int, steps: int, floor: float = 0.1):
    """The factor of the learning rate after `step` applied steps: linear warm-up over `warmup`
    steps, then a cosine down to `floor` at `steps`, and `floor` after."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
    return factor


def split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int):
    order = np.random.RandomState(seed).permutation(len(x))
    cut = len(x) - int(round(len(x) * test_fraction))
    train, test = order[:cut], order[cut:]
    as_ds = lambda idx: TensorDataset(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]))
    return as_ds(train), as_ds(test)


# digits -------------------------------------------------------------------------------------------


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (1,797 images), read from the file the package ships.

    Reading the CSV directly skips importing scikit-learn, which costs about a second per process.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise JobError("the digits job needs scikit-learn: pip install 'idlegrad[digits]'")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    if os.path.exists(path):
        with gzip.open(path, "rt") as fh:
            data = np.loadtxt(fh, delimiter=",", dtype=np.float32)
        return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # the file moved: take the slow, public way

    bunch = load_digits()
    return bunch.data.astype(np.float32), bunch.target.astype(np.int64)


def digits(hidden: int = 128, lr: float = 1e-2, batch_size: int = 32, seed: int = 0,
           norm: str = "none", weight_decay: float = 0.0, warmup: int = 0,
           schedule_steps: int = 0, clip: float = 0.0, dropout: float = 0.0) -> Job:
    """Handwritten digits 0-9 with a 64-hidden-10 MLP and Adam.

    The recipe arguments are off by default: `norm=batch` puts a BatchNorm1d in the MLP,
    `weight_decay` makes the optimizer AdamW without decay on biases and norms, `schedule_steps`
    (with `warmup`) a warm-up and cosine learning-rate schedule over that many applied steps,
    `clip` a global gradient-norm clip, `dropout` a Dropout of that probability after the hidden
    layer (a job drawing randomness: common/slot_random.py)."""
    if norm not in ("none", "batch"):
        raise JobError(f"digits: norm must be none or batch, got {norm!r}")
    if weight_decay < 0 or warmup < 0 or schedule_steps < 0 or clip < 0:
        raise JobError("digits: weight_decay, warmup, schedule_steps and clip must be >= 0")
    if not 0 <= dropout < 1:
        raise JobError(f"digits: dropout must be in [0, 1), got {dropout!r}")
    scheduled = schedule_steps > 0 or warmup > 0

    def build_datasets():
        x, y = load_digits_arrays()
        return split(x / 16.0, y, test_fraction=0.2, seed=seed)

    return Job(
        name="digits",
        build_model=lambda: mlp([64, hidden, 10], batch_norm=norm == "batch", dropout=dropout),
        build_datasets=build_datasets,
        loss=classification_loss,
        build_optimizer=adam(lr, weight_decay),
        batch_size=batch_size,
        lr_lambda=warmup_cosine(warmup, max(schedule_steps, warmup)) if scheduled else None,
        clip_norm=clip or None,
    )


# synthetic ----------------------------------------------------------------------------------------


def hidden_width(params: int, features: int, classes: int) -> int:
    """Width h of a features-h-h-classes MLP whose parameter count is closest to `params`."""
    b = features + classes + 2
    c = classes - params
    return max(1, round((-b + math.sqrt(b * b - 4 * c)) / 2))


def synthetic(params: int = 100_000, samples: int = 8192, features: int = 32, classes: int = 10,
              batch_size: int = 64, lr: float = 0.05, seed: int = 0) -> Job:
    """A learnable classification task generated from a seed, with a model of about `params`."""
    if params < 1 or samples < 2 or features < 1 or classes < 2:
        raise JobError("synthetic: params >= 1, samples >= 2, features >= 1, classes >= 2")
    width = hidden_width(params, features, classes)

    def build_datasets():
        rng = np.random.RandomState(seed)
        x = rng.standard_normal((samples, features)).astype(np.float32)
        teacher = rng.standard_normal((features, classes)).astype(np.float32)
        logits = x @ teacher + 0.5 * rng.standard_normal((samples, classes)).astype(np.float32)
        return split(x, logits.argmax(axis=1).astype(np.int64), test_fraction=0.1, seed=seed)

    return Job(
        name="synthetic",
        build_model=lambda: mlp([features, width, width, classes]),
        build_datasets=build_datasets,
        loss=classification_loss,
        build_optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        batch_size=batch_size,
    )



# packed -------------------------------------------------------------------------------------------


def packed(data: str, features: int, classes: int, hidden: int = 64, lr: float = 0.05,
           batch_size: int = 64, test_samples: int = 1024) -> Job:
    """A classifier over packed arrays (`idlegrad data pack FILE.npz`): a features-hidden-classes
    MLP (hidden=0: linear) on the manifest's `inputs` (flattened, as floats) and class-id
    `targets`. `data` is the manifest's sha256, which the coordinator's `--data DIR` fills in;
    workers fetch the shards they read into their cache. Its test set is the first
    `test_samples` training samples (a pack holds one data set): a training-loss probe."""
    from .blobs import BlobError, check_sha256

    try:
        check_sha256(data)
    except BlobError as exc:
        raise JobError(f"packed: data must be a manifest's sha256 ({exc})") from None
    if features < 1 or classes < 2 or hidden < 0 or test_samples < 1:
        raise JobError("packed: features >= 1, classes >= 2, hidden >= 0, test_samples >= 1")

    def build_datasets(store):
        from torch.utils.data import Subset

        from .sharded import ShardedDataset

        train = ShardedDataset.from_store(data, store)
        names = [f.name for f in train.manifest.fields]
        if names != ["inputs", "targets"]:
            raise JobError(f"packed: the manifest's fields are {names}, not [inputs, targets] "
                           "(pack an .npz of inputs and targets)")
        inputs, targets = train.manifest.fields
        if math.prod(inputs.shape) != features:
            raise JobError(f"packed: a sample's inputs have {math.prod(inputs.shape)} values "
                           f"(shape {list(inputs.shape)}), not features={features}")
        if targets.shape != () or not targets.dtype.startswith(("int", "uint")):
            raise JobError(f"packed: targets must be one integer class id per sample, not "
                           f"{targets.dtype} of shape {list(targets.shape)}")
        return train, Subset(train, range(min(test_samples, len(train))))

    def loss(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x.reshape(len(x), -1).float()), y.long())

    def evaluate(model: nn.Module, test) -> dict[str, float]:
        from torch.utils.data._utils.collate import default_collate

        x, y = default_collate([test[i] for i in range(len(test))])
        logits = model(x.reshape(len(x), -1).float())
        return {"loss": float(nn.functional.cross_entropy(logits, y.long())),
                "accuracy": float((logits.argmax(dim=1) == y.long()).float().mean())}

    sizes = [features, hidden, classes] if hidden else [features, classes]
    return Job(
        name="packed",
        build_model=lambda: mlp(sizes),
        build_datasets=build_datasets,
        loss=loss,
        build_optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        batch_size=batch_size,
        evaluate=evaluate,
        data=data,
    )


# lm -----------------------------------------------------------------------------------------------

# Shards of a packed corpus: small enough that a cold worker's first shard comes in seconds and
# the shard-aware order has shards to shuffle (the standard library's ~30 MB: about 8 shards).
CORPUS_SHARD_MB = 4.0
# Files of a corpus folder that go to the held-out set: one in VALIDATION_EVERY, picked by a hash of
# the relative path, so the split is the same on every machine and no file is in both.
VALIDATION_EVERY = 50
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus() -> str:
    """The standard library's own source folder: tens of MB of real text every Python has."""
    import sysconfig

    return sysconfig.get_paths()["stdlib"]


def corpus_files(only_python: bool) -> Callable[[str], bool]:
    def include(rel: str) -> bool:
        if any(part in SKIPPED_DIRS for part in rel.split("/")[:-1]):
            return False
        return rel.endswith(".py") or not only_python
    return include


def held_out_files(files: list[str]) -> set[str]:
    """One file in VALIDATION_EVERY, picked by a hash of its relative path; at least one (the
    lowest hash) when the corpus is too small for the hash to pick any."""
    rank = {rel: int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) for rel in files}
    held = {rel for rel, h in rank.items() if h % VALIDATION_EVERY == 0}
    return held or ({min(rank, key=rank.get)} if len(files) > 1 else set())


def pack_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "idlegrad", "packs")


def packed_corpus(corpus: str, window: int, only_python: bool) -> str:
    """The pack of `corpus` cut into `window`-byte samples, its held-out files last (the
    manifest's `held_out_samples`): packed once per state of the corpus into the user's cache, so
    a later build with the same files reuses it. Returns the pack's folder."""
    from . import blobs

    if not os.path.isdir(corpus):
        raise JobError(f"lm: corpus {corpus!r} is not a folder")
    include = corpus_files(only_python)
    listing = hashlib.sha256(f"{window}:{only_python}:{CORPUS_SHARD_MB}".encode())
    files = []
    for base, dirs, names in os.walk(corpus):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = os.path.join(base, name)
            rel = os.path.relpath(path, corpus).replace(os.sep, "/")
            if name.startswith(".") or not include(rel) or os.path.islink(path):
                continue
            stat = os.stat(path)
            listing.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
            files.append(rel)
    held = held_out_files(files)
    target = os.path.join(pack_cache_dir(), "corpus-" + listing.hexdigest()[:24])
    if os.path.exists(os.path.join(target, blobs.MANIFEST_FILE)):
        return target
    os.makedirs(pack_cache_dir(), exist_ok=True)
    temp = tempfile.mkdtemp(dir=pack_cache_dir(), prefix=".packing-")
    try:
        blobs.pack_corpus(corpus, temp, window, CORPUS_SHARD_MB, include=include,
                          held_out=held.__contains__)
        try:
            os.rename(temp, target)
        except OSError:  # another process packed the same corpus first: theirs is as good
            pass
    except blobs.DataError as exc:
        raise JobError(f"lm: {exc}") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return target


def train_and_held_out(data):
    """A corpus pack's two parts: the samples before its held-out tail, and that tail."""
    held = data.manifest.decode.get("held_out_samples")
    if type(held) is not int or not 0 < held < len(data):
        raise JobError("lm: the pack has no held-out part (pack it with the lm job: a "
                       "coordinator started with --job lm packs its corpus itself)")
    return data.view(0, len(data) - held), data.view(len(data) - held, held)


def lm(corpus: str = "", size: str = "tiny", context: int = 128, batch_size: int = 32,
       lr: float = 2e-3, warmup: int = 100, steps: int = 5000, weight_decay: float = 0.1,
       clip: float = 1.0, eval_windows: int = 256, data: Optional[str] = None) -> Job:
    """A byte-level decoder-only transformer on a folder of text (`corpus`; by default the Python
    standard library's source), cut into windows of `context`+1 bytes. The recipe: AdamW
    (no decay on biases and norms), linear warm-up then cosine decay over `steps` applied steps,
    clipping at global norm `clip`. Metric: held-out bits per byte over `eval_windows` windows.

    The coordinator packs the corpus (job.pack) and serves it; workers get `data`, the pack's
    manifest, and fetch its shards, so they need neither the corpus nor the same Python."""
    from .blobs import BlobError, check_sha256
    from .models import LM_SIZES, ByteTransformer, byte_loss
    from .sharded import ShardedDataset

    if size not in LM_SIZES:
        raise JobError(f"lm: size must be one of {', '.join(LM_SIZES)}, got {size!r}")
    if not 8 <= context <= 4096:
        raise JobError(f"lm: context must be between 8 and 4096, got {context}")
    if eval_windows < 1 or steps < 1 or warmup < 0 or clip < 0 or weight_decay < 0:
        raise JobError("lm: eval_windows and steps >= 1; warmup, clip, weight_decay >= 0")
    if data is not None:
        try:
            check_sha256(data)
        except BlobError as exc:
            raise JobError(f"lm: data must be a manifest's sha256 ({exc})") from None
    width, layers, heads = LM_SIZES[size]

    def pack() -> str:
        return packed_corpus(corpus or stdlib_corpus(), context + 1, only_python=not corpus)

    def build_datasets(store=None):
        if data is None:
            return train_and_held_out(ShardedDataset(os.path.join(pack(), "manifest.json")))
        return train_and_held_out(ShardedDataset.from_store(data, store))

    def evaluate_sums(model: nn.Module, windows) -> dict[str, tuple[float, float]]:
        # bits per byte is the loss in base 2: its sum is the loss sum over ln 2
        loss_sum = float(byte_loss(model, windows)) * len(windows)
        return {"loss": (loss_sum, len(windows)),
                "bits_per_byte": (loss_sum / math.log(2), len(windows))}

    def build_optimizer(named_parameters):
        decayed = [p for n, p in named_parameters if not no_decay(n, p)]
        undecayed = [p for n, p in named_parameters if no_decay(n, p)]
        return adamw([{"params": decayed, "weight_decay": weight_decay},
                      {"params": undecayed, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))

    return Job(
        name="lm",
        build_model=lambda: ByteTransformer(context, width, layers, heads),
        build_datasets=build_datasets,
        loss=byte_loss,
        build_optimizer=build_optimizer,
        batch_size=batch_size,
        evaluate_sums=evaluate_sums,
        eval_samples=eval_windows,
        data=data,
        lr_lambda=warmup_cosine(warmup, steps) if warmup or steps else None,
        clip_norm=clip or None,
        pack=pack if data is None else None,
    )


# resnet -------------------------------------------------------------------------------------------

CIFAR_RECORD = 1 + 3 * 32 * 32
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def read_cifar_batches(folder: str):
    """CIFAR-10's binary version: data_batch_*.bin (train) and test_batch.bin, each a run of
    records of one label byte and 3x32x32 pixel bytes. Returns ((x, y) train, (x, y) test), x
    uint8 of shape (n, 3, 32, 32)."""

    def read(paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
        chunks = []
        for path in paths:
            raw = np.fromfile(path, dtype=np.uint8)
            if raw.size == 0 or raw.size % CIFAR_RECORD:
                raise JobError(f"resnet: {path} is not CIFAR-10 binary ({raw.size} bytes is not a "
                               f"multiple of {CIFAR_RECORD})")
            chunks.append(raw.reshape(-1, CIFAR_RECORD))
        records = np.concatenate(chunks)
        labels = records[:, 0].astype(np.int64)
        if labels.max() > 9:
            raise JobError(f"resnet: a label above 9 in {', '.join(paths)}: not CIFAR-10 binary")
        return records[:, 1:].reshape(-1, 3, 32, 32).copy(), labels

    train = sorted(glob.glob(os.path.join(folder, "data_batch_*.bin")))
    test = os.path.join(folder, "test_batch.bin")
    if not train or not os.path.isfile(test):
        raise JobError(f"resnet: {folder!r} needs CIFAR-10 binary batches (data_batch_*.bin and "
                       "test_batch.bin)")
    return read(train), read([test])


class Normalised(nn.Module):
    """Pixels travel and are stored as bytes (4x fewer than floats), and are scaled here."""

    def __init__(self, net: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x.float() / 255 - self.mean) / self.std)


def resnet(data: str = "", width: int = 16, depth: int = 1, batch_size: int = 64, lr: float = 0.05,
           momentum: float = 0.9, weight_decay: float = 5e-4, seed: int = 0) -> Job:
    """A small ResNet with BatchNorm. `data`: a folder of CIFAR-10 binary batches; by default
    scikit-learn's 8x8 digits as one-channel images (the image data every install can have)."""
    from .models import ResNet

    if width < 1 or depth < 1:
        raise JobError(f"resnet: width and depth must be at least 1, got {width} and {depth}")

    if data:
        channels, mean, std = 3, CIFAR_MEAN, CIFAR_STD

        def build_datasets():
            (xtr, ytr), (xte, yte) = read_cifar_batches(data)
            as_ds = lambda x, y: TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
            return as_ds(xtr, ytr), as_ds(xte, yte)
    else:
        channels, mean, std = 1, (0.5,), (0.5,)

        def build_datasets():
            x, y = load_digits_arrays()
            images = (x.reshape(-1, 1, 8, 8) * (255 / 16)).round().astype(np.uint8)
            return split(images, y, test_fraction=0.2, seed=seed)

    return Job(
        name="resnet",
        build_model=lambda: Normalised(ResNet(channels, 10, width, depth), mean, std),
        build_datasets=build_datasets,
        loss=classification_loss,
        build_optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum,
                                                       weight_decay=weight_decay, nesterov=True),
        batch_size=batch_size,
    )
