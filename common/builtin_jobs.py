"""Jobs that ship with idlegrad: `digits` (a real data set), `synthetic` (sized for benchmarks)
and `packed` (a classifier over packed arrays, fetched by manifest).

digits and synthetic build their data without any download, identically on every machine: digits
from the CSV that scikit-learn ships, synthetic from numpy's legacy RandomState, whose stream is
frozen. packed reads shards named by their sha256, so every machine reads the same bytes.
A built-in job's name (common/job_loading.py's BUILTIN_JOBS) is its factory's name here.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .errors import JobError
from .job_definition import Job


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def mlp(sizes: list[int], batch_norm: bool = False) -> nn.Sequential:
    """Linear layers with ReLU between them; with `batch_norm`, a BatchNorm1d before each ReLU."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            if batch_norm:
                layers.append(nn.BatchNorm1d(b))
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def no_decay(name: str, parameter: nn.Parameter) -> bool:
    """Biases and normalisation weights (one-dimensional parameters) take no weight decay."""
    return parameter.dim() <= 1


def adam(lr: float, weight_decay: float):
    """An optimizer factory: Adam, or with `weight_decay` AdamW whose groups leave biases and
    norms undecayed (it takes named parameters: common/job.py's make_optimizer)."""
    if not weight_decay:
        return lambda params: torch.optim.Adam(params, lr=lr)

    def build_optimizer(named_parameters):
        decayed = [p for n, p in named_parameters if not no_decay(n, p)]
        undecayed = [p for n, p in named_parameters if no_decay(n, p)]
        return torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                  {"params": undecayed, "weight_decay": 0.0}], lr=lr)
    return build_optimizer


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
           schedule_steps: int = 0, clip: float = 0.0) -> Job:
    """Handwritten digits 0-9 with a 64-hidden-10 MLP and Adam.

    The recipe arguments are off by default: `norm=batch` puts a BatchNorm1d in the MLP,
    `weight_decay` makes the optimizer AdamW without decay on biases and norms, `schedule_steps`
    (with `warmup`) a warm-up and cosine learning-rate schedule over that many applied steps,
    `clip` a global gradient-norm clip."""
    if norm not in ("none", "batch"):
        raise JobError(f"digits: norm must be none or batch, got {norm!r}")
    if weight_decay < 0 or warmup < 0 or schedule_steps < 0 or clip < 0:
        raise JobError("digits: weight_decay, warmup, schedule_steps and clip must be >= 0")
    scheduled = schedule_steps > 0 or warmup > 0

    def build_datasets():
        x, y = load_digits_arrays()
        return split(x / 16.0, y, test_fraction=0.2, seed=seed)

    return Job(
        name="digits",
        build_model=lambda: mlp([64, hidden, 10], batch_norm=norm == "batch"),
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
