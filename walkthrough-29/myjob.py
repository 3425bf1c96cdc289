# The issue-29 walkthrough's own job: the README's "Writing a job" example, with Dropout and
# BatchNorm (`summed=True`: a loss that sums, for the build-time warning)
import torch
from torch import nn
from torch.utils.data import TensorDataset
from idlegrad.common.job import Job


def make_job(hidden: int = 64, lr: float = 0.01, drop: float = 0.2, summed: bool = False) -> Job:
    def build_datasets():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4000, 20, generator=g)
        y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long()
        return TensorDataset(x[:3200], y[:3200]), TensorDataset(x[3200:], y[3200:])

    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="sum" if summed else "mean")

    return Job(
        name="halfspace-dropout",
        build_model=lambda: nn.Sequential(nn.Linear(20, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                          nn.Dropout(drop), nn.Linear(hidden, hidden),
                                          nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(drop),
                                          nn.Linear(hidden, 2)),
        build_datasets=build_datasets,
        loss=loss,
        build_optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        batch_size=32,
    )
