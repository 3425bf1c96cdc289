"""The files a coordinator appends to as it runs: the metrics log (one JSON object per evaluation,
and a final one with the run's tallies) and the ledger (ledger.py: slots sent, results taken,
rounds applied, for the audit). Either may be off. Both are `AppendFile`s: a full disk is one
event (`report`, the coordinator's events), and training goes on."""

from __future__ import annotations

import json
from typing import Callable, Optional

from .ledger import AppendFile, LedgerWriter


class RunRecords:
    def __init__(self, metrics_path: Optional[str], ledger_path: Optional[str], instance: str,
                 report: Optional[Callable] = None):
        self.metrics_path, self.ledger_path, self.instance = metrics_path, ledger_path, instance
        self.report = report
        self._metrics: Optional[AppendFile] = None
        self.ledger: Optional[LedgerWriter] = None

    def open(self, **start) -> None:
        if self.metrics_path:
            self._metrics = AppendFile(self.metrics_path, "the metrics log", self.report)
        if self.ledger_path:
            self.ledger = LedgerWriter(self.ledger_path, self.instance, self.report)
            self.ledger.write("start", **start)
    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self.ledger is not None:
            self.ledger.close()

    def metrics(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")

    def sync(self) -> None:
        """The ledger on disk, before a checkpoint is: never behind it, even after a power loss."""
        if self.ledger is not None:
            self.ledger.sync()

    def write(self, event: str, **fields) -> None:
        """A ledger record (nothing without a ledger)."""
        if self.ledger is not None:
            self.ledger.write(event, **fields)
