"""How much a code's decoding multiplies the rounding of the results it combines.

For each code, Gaussian partition gradients g_j (float32, `--values` each) and `--patterns` random
arrival orders of the slots. Along each order the results arrive one by one and the round is
decoded at the first prefix that `coding.decode` accepts (the scheduler tries after every arrival;
the prefix is found by bisection, decodability being monotone in the arrived set). Each arrived
slot's result is computed the way a worker does, f_i = sum_j E[i, j] g_j accumulated in float32,
and sent as float32 or rounded to bfloat16; the coordinator sums a_i f_i in float32. The error is
||decoded - sum_j g_j|| / ||sum_j g_j|| against the exact (float64) sum; the table shows the worst
over the patterns. `bf16 ref` is the rounding of the inputs themselves: the same relative error
for the plain sum of the partitions each rounded to bfloat16 (what `none` would give), and `x ref`
the worst ratio of the decoded bfloat16 error to it. `amp` is the worst amplification of the
decoding weights, max_j sum_i |a_i E[i, j]| (1: no cancellation).

    python benchmarks/coding_error.py                 # the default codes
    python benchmarks/coding_error.py --codes 6:1,40:3 --patterns 60 --json

`--codes` takes n:s pairs (coding.cyclic(n, s), what `--redundancy cyclic:S` builds over n
partitions), `h` for heterogeneous codes and `r:k:R` for replicate. With `--json` the last line is
{"codes": {name: {"float32": worst, "bfloat16": worst, "bf16_ref": ..., "bf16_x_ref": ..., "amp":
...}}, "worst_float32": ..., "worst_bf16_x_ref": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT = "6:1,12:2,24:2,40:3,100:2,3:1,5:2,9:7,15:7,64:7,1000:7,h,r:8:3"


def build(spec: str):
    from idlegrad.common import coding
    if spec == "h":
        return coding.heterogeneous([1.0, 2.0, 1.0, 4.0, 3.0, 0.5, 2.5, 1.5], 12, replicas=2)
    if spec.startswith("r:"):
        _, k, r = spec.split(":")
        return coding.replicate(int(k), int(r))
    n, s = spec.split(":")
    return coding.cyclic(int(n), int(s))


def first_decodable(code, order):
    """(weights, prefix length) at the shortest prefix of `order` that decodes."""
    from idlegrad.common.coding import decode
    if decode(code, order) is None:
        return None, None
    lo, hi = 1, len(order)
    while lo < hi:  # the smallest prefix length that decodes
        mid = (lo + hi) // 2
        if decode(code, order[:mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return decode(code, order[:hi]), hi


def measure(code, patterns: int, values: int, seed: int) -> dict:
    import torch
    rng = np.random.default_rng(seed)
    k = code.partitions
    grads = torch.from_numpy(rng.standard_normal((k, values)).astype(np.float32))
    exact = grads.double().sum(0)
    scale = float(exact.norm())
    ref = float((grads.to(torch.bfloat16).double().sum(0) - exact).norm()) / scale
    matrix = torch.from_numpy(code.matrix.astype(np.float32))
    worst = {"float32": 0.0, "bfloat16": 0.0, "amp": 0.0, "arrived": 0}
    for _ in range(patterns):
        order = [int(i) for i in rng.permutation(code.slots)]
        weights, used = first_decodable(code, order)
        if weights is None:
            raise SystemExit(f"{code.name} {code.slots}x{k}: a full arrival did not decode")
        amp = np.zeros(k)
        for i, a in weights.items():
            amp += np.abs(a * code.matrix[i])
        worst["amp"] = max(worst["amp"], float(amp.max()))
        worst["arrived"] = max(worst["arrived"], used)
        for dtype in ("float32", "bfloat16"):
            total = torch.zeros(values, dtype=torch.float32)
            for i, a in weights.items():
                cols = torch.nonzero(matrix[i]).flatten()
                f = torch.zeros(values, dtype=torch.float32)  # the worker's float32 sum
                for j in cols.tolist():
                    f += matrix[i, j] * grads[j]
                if dtype == "bfloat16":
                    f = f.to(torch.bfloat16).float()
                total += np.float32(a) * f
            err = float((total.double() - exact).norm()) / scale
            worst[dtype] = max(worst[dtype], err)
    worst["bf16_ref"] = ref
    worst["bf16_x_ref"] = worst["bfloat16"] / ref
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codes", default=DEFAULT, help=f"comma-separated (default: {DEFAULT})")
    parser.add_argument("--patterns", type=int, default=60, help="arrival orders per code")
    parser.add_argument("--values", type=int, default=20_000, help="values per partition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = {}
    print(f"{'code':>22} {'slots':>5} {'k':>5} {'float32':>9} {'bfloat16':>9} {'bf16 ref':>9} "
          f"{'x ref':>6} {'amp':>9} {'secs':>5}")
    for spec in args.codes.split(","):
        start = time.perf_counter()
        code = build(spec.strip())
        got = measure(code, args.patterns, args.values, args.seed)
        name = f"{code.name} {code.slots}x{code.partitions}"
        out[name] = {key: got[key] for key in ("float32", "bfloat16", "bf16_ref", "bf16_x_ref",
                                                "amp")}
        print(f"{name:>22} {code.slots:>5} {code.partitions:>5} {got['float32']:>9.2e} "
              f"{got['bfloat16']:>9.2e} {got['bf16_ref']:>9.2e} {got['bf16_x_ref']:>6.2f} "
              f"{got['amp']:>9.3g} {time.perf_counter() - start:>5.1f}", flush=True)
    if args.json:
        print(json.dumps({"codes": out,
                          "worst_float32": max(v["float32"] for v in out.values()),
                          "worst_bf16_x_ref": max(v["bf16_x_ref"] for v in out.values())}))


if __name__ == "__main__":
    main()
