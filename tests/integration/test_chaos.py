"""The chaos benchmark's fast subset: a real coordinator and 5 real workers per fault, faults
injected at a quicker pace, the coordinator's ledger audited sample by sample."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def test_chaos_subset_loses_and_duplicates_nothing(tmp_path):
    # The driven faults; the poisoned and the unlisted worker have their own, quicker tests
    # (test_poison.py, test_security.py).
    faults = ["restart", "kill9"]
    out = subprocess.run(
        [sys.executable, str(CHAOS), "--faults", ",".join(faults), "--epochs", "15",
         "--pace", "0.3", "--target", "0.9", "--keep", str(tmp_path / "chaos"), "--json",
         "--timeout", "240"],
        capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])["faults"]
    print(out.stdout)
    assert set(summary) == set(faults)
    for fault, row in summary.items():
        assert row["lost"] == 0 and row["duplicates"] == 0, (fault, row)
        assert row["reached"], (fault, row)
        assert row["tracebacks"] == 0, (fault, row)
        assert row["slowdown"] > 0
    assert summary["restart"]["injections"] >= 1 and summary["kill9"]["injections"] >= 1
