"""Issue-29 walkthrough: a BatchNorm job's slot fails when the worker's micro-batch is 1 sample,
as the worker's speed-sized micro-batch becomes after a slow first measurement (engine.py:
micro_batch = max(1, 0.2 s / s_per_sample)), or when a part leaves a remainder of one sample."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from myjob import make_job  # noqa: E402
from idlegrad.common.job import accumulate_coded_gradient, build  # noqa: E402

built = build(make_job(), "cpu", 0)
for micro in (16, 31, 1):
    built.model.grads.zero_()
    try:
        accumulate_coded_gradient(built.job, built.model, built.train, 0, [[0, 0, 32]], [1.0],
                                  micro_batch=lambda size=micro: size)
        print(f"micro-batch {micro}: ok")
    except ValueError as exc:
        print(f"micro-batch {micro}: FAILS: {exc}")
