"""What a job is: the `Job` a job factory returns.

Below both the built-in jobs and the loading of job specs (common/job_loading.py), which need it,
and free of torch at import, so that the front end can name jobs without loading torch. Job
authors import it as `idlegrad.common.job.Job`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

MIXED_PRECISION = ("bf16",)


@dataclass(frozen=True)
class Job:
    """What to train. `loss` returns the *mean* loss of the batch it is given (torch's default).

    The recipe fields after `evaluate` are optional (docs/architecture.md, "Recipes"):

    - `build_optimizer` gets the model's parameters; if its argument is *named*
      `named_parameters`, it gets (name, parameter) pairs instead, to build groups by name (no
      weight decay on biases and norms, say).
    - `lr_lambda(step)`: the factor of each group's initial learning rate after `step` applied
      steps (torch's LambdaLR); or `build_scheduler(optimizer)`: any torch LR scheduler, stepped
      once per applied step. Not both. Its state is in every checkpoint.
    - `clip_norm`: the decoded round's mean gradient is clipped to this global L2 norm on the
      coordinator before the step, whatever the redundancy code (and each inner step of a local
      task, on the worker).
    - `mixed_precision="bf16"`: workers on CUDA compute the loss under bfloat16 autocast;
      gradients stay in the parameters' dtype. CPU workers and the coordinator are unchanged.
    - `collate(samples)`: makes a batch of a list of samples, where torch's default collate
      cannot.
    - `evaluate_sums(model, batch)`: the evaluation of one batch of test samples as
      `{metric: (sum, count)}`; a metric is the sum of its sums over the count of its counts,
      whatever batches the test set was cut into. With it, evaluation can be handed to workers
      (a range of the test set each, `--eval-on`), and the coordinator uses it too. Without it
      and without `evaluate`, the default is classification's: `loss` (the mean loss) and, for
      class logits, `accuracy`, computed the same way. A job whose `evaluate` returns means has
      them computed on the coordinator only.
    - `eval_samples`: evaluate the first this many test samples (None: all).
    - `draws_randomness`: whether computing the job draws from torch's generators (dropout,
      augmentation in the data set, noise in the loss); None: found when the job is built
      (common/slot_random.py). Such a job is computed in micro-batches of `random_block`
      samples on every side, each with torch's generators seeded from the run's seed, the model
      version and the samples' positions, so that a slot computed again draws alike.
    """

    name: str
    build_model: Callable[[], nn.Module]
    build_datasets: Callable[[], tuple[Dataset, Dataset]]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    build_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batch_size: int
    evaluate: Optional[Callable[[nn.Module, Dataset], dict[str, float]]] = None
    # Data declared by manifest: the sha256 of a packed data set (`idlegrad data pack`). With it,
    # `build_datasets(store)` is given a BlobStore (common/sharded.py) that holds that manifest and
    # its shards: the coordinator's pack folder, or a worker's cache, which fetches what it lacks.
    data: Optional[str] = None
    lr_lambda: Optional[Callable[[int], float]] = None
    build_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None
    clip_norm: Optional[float] = None
    mixed_precision: Optional[str] = None
    collate: Optional[Callable[[list], Any]] = None
    # A job that can pack its own data (a job-arg names a local corpus, say) and takes `data`:
    # `pack()` returns the folder of that pack. A coordinator started without --data calls it
    # and serves the pack as if given --data DIR, so workers fetch the data instead of needing
    # the corpus; a job built without a store (one process, a baseline) reads it locally.
    pack: Optional[Callable[[], str]] = None
    evaluate_sums: Optional[Callable[[nn.Module, Any], dict[str, tuple[float, float]]]] = None
    eval_samples: Optional[int] = None
    draws_randomness: Optional[bool] = None
    random_block: int = 64
