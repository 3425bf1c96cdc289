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


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


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


def digits(hidden: int = 128, lr: float = 1e-2, batch_size: int = 32, seed: int = 0) -> Job:
    """Handwritten digits 0-9 with a 64-hidden-10 MLP and Adam."""

    def build_datasets():
        x, y = load_digits_arrays()
        return split(x / 16.0, y, test_fraction=0.2, seed=seed)

    return Job(
        name="digits",
        build_model=lambda: mlp([64, hidden, 10]),
        build_datasets=build_datasets,
        loss=classification_loss,
        build_optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        batch_size=batch_size,
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
