"""Delay compensation: a stale gradient corrected towards the gradient at the current model.

A round planned at version v is computed on the model w_sent of v; when it is applied the model
is w_now. DC-ASGD (Zheng et al. 2017, "Asynchronous Stochastic Gradient Descent with Delay
Compensation") takes the first-order Taylor term of the gradient in w, with the Hessian
approximated by the gradient's own outer product kept to its diagonal (lambda g*g, cheap and
positive semi-definite):

    g(w_now) ~ g + lambda * g * g * (w_now - w_sent)      (elementwise)

- `dc:LAMBDA` (constant, the paper's DC-ASGD-c): lambda as given.
- `dc-a:LAMBDA` (adaptive, DC-ASGD-a): lambda / sqrt(m), m a running mean of g*g over the
  applied rounds (momentum 0.95): the correction is then about lambda |g| |w_now - w_sent| in
  relative terms whatever the gradient's scale.

The setting (`DelayCompensation`, parsed from the flag) is in coordinator/staleness.py, which
the configuration check reads without torch. Off by default: measured in docs/scaling.md ("Delay compensation"). The correction needs the
model the round was computed on: the model state keeps a snapshot of every version an open
round needs, so it is there unless the round outlived it (then the plain staleness rule alone
applies, and `without_snapshot` counts it).
"""

from __future__ import annotations

from typing import Optional

import torch

from .staleness import DelayCompensation

MEAN_MOMENTUM = 0.95  # the running mean of g*g of the adaptive variant (the paper's)
EPSILON = 1e-7  # under sqrt(m): a coordinate that never had a gradient gets no division by 0


def compensate_(grad: torch.Tensor, now: torch.Tensor, sent: torch.Tensor, lam: float,
                mean_square: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DC-ASGD's correction, in place: grad + lam * grad * grad * (now - sent), with lam divided
    elementwise by sqrt(mean_square) when one is given (the adaptive variant). Returns `grad`.

    Written as grad * (1 + lam * grad * (now - sent) [/ sqrt(m)]): one temporary the size of
    the model, not three."""
    factor = torch.sub(now, sent)
    factor.mul_(grad).mul_(lam)
    if mean_square is not None:
        factor.div_(mean_square.sqrt().add_(EPSILON))
    factor.add_(1.0)
    return grad.mul_(factor)


class DelayCompensator:
    """The coordinator's compensation: its setting, the adaptive variant's running mean, and
    counts of the rounds corrected and of the stale ones it could not correct."""

    def __init__(self, setting: DelayCompensation):
        self.setting = setting
        self.mean_square: Optional[torch.Tensor] = None  # dc-a: running mean of g*g
        self.compensated = 0  # stale rounds corrected
        self.without_snapshot = 0  # stale rounds applied plainly: their model was not kept

    def observe(self, grad: torch.Tensor) -> None:
        """Every applied round's mean gradient (before correction) joins the running mean of
        g*g (dc-a only; the first one starts it)."""
        if self.setting.kind != "dc-a":
            return
        if self.mean_square is None:
            self.mean_square = grad * grad
        else:
            self.mean_square.mul_(MEAN_MOMENTUM).addcmul_(grad, grad, value=1 - MEAN_MOMENTUM)

    def correct_(self, grad: torch.Tensor, now: torch.Tensor, sent: Optional[torch.Tensor],
                 staleness: int) -> bool:
        """Correct `grad` (a round `staleness` versions old, computed on `sent`) in place;
        False when nothing was done (fresh, off, or `sent` not kept)."""
        if not self.setting.on or staleness <= 0:
            return False
        if sent is None:
            self.without_snapshot += 1
            return False
        compensate_(grad, now, sent, self.setting.lam,
                    self.mean_square if self.setting.kind == "dc-a" else None)
        self.compensated += 1
        return True
