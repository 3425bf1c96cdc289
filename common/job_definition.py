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


@dataclass(frozen=True)
class Job:
    """What to train. `loss` returns the *mean* loss of the batch it is given (torch's default)."""

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
