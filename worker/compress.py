"""Results on the wire: an outcome as its message, and smaller results: bfloat16 with error
feedback (the coordinator's --result-dtype).

Rounding a change to bfloat16 keeps 8 bits of mantissa: each value is off by up to 0.4%. Error
feedback (Seide et al. 2014; Karimireddy et al. 2019) keeps what the rounding dropped and adds it
to the next result, so the errors do not pile up into a bias: over many results the sum the
coordinator receives tracks the sum of the true changes to within one rounding.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..common import protocol as proto
from ..common.tensors import TORCH_DTYPES, to_blob

RESULT_DTYPES = ("float32", "bfloat16")


class ErrorFeedback:
    def __init__(self, dtype: str = "float32"):
        if dtype not in RESULT_DTYPES:
            raise ValueError(f"result dtype {dtype!r} unknown: use one of {', '.join(RESULT_DTYPES)}")
        self.dtype = TORCH_DTYPES[dtype]
        self.residual: Optional[torch.Tensor] = None

    def encode(self, result: torch.Tensor) -> torch.Tensor:
        """`result` as it should travel: rounded to the wire dtype, plus the error carried from
        the results before it; the new rounding error is carried on."""
        if result.dtype == self.dtype:
            return result
        if self.residual is None or self.residual.shape != result.shape:
            self.residual = torch.zeros_like(result)
        wanted = result + self.residual
        sent = wanted.to(self.dtype)
        self.residual = wanted - sent.to(result.dtype)
        return sent

    def reset(self) -> None:
        self.residual = None


def result_message(outcome, feedback: ErrorFeedback) -> proto.Result:
    """A gradient or local outcome (engine.Outcome) as the coordinator wants it."""
    return proto.Result(
        slot=outcome.slot, version=outcome.version, samples=outcome.samples, loss=outcome.loss,
        compute_s=outcome.compute_s, gradient=to_blob(feedback.encode(outcome.gradient)),
        waited_s=outcome.waited_s,
        buffers=None if outcome.buffers is None else to_blob(outcome.buffers))


def eval_message(outcome) -> proto.EvalResult:
    """An evaluation's outcome: its sums, bounded as the wire wants them."""
    return proto.EvalResult(
        slot=outcome.slot, version=outcome.version, compute_s=outcome.compute_s,
        sums={name[:proto.MAX_METRIC_NAME]: [_wire_sum(total), _wire_sum(count)]
              for name, (total, count) in list(outcome.sums.items())[:proto.MAX_EVAL_METRICS]})


def _wire_sum(value: float) -> float:
    """The wire takes finite sums only: a diverged model's (inf, nan) reads as a huge one."""
    value = float(value)
    return value if math.isfinite(value) else (-1e300 if value == -math.inf else 1e300)
