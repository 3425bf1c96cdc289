"""The ledger: an append-only JSON-lines account of slots sent, results acknowledged and rounds
applied, across coordinator restarts (`--ledger FILE`), and its audit.

Every coordinator process appends to the same file: a `start` record (its instance and the
version it resumed at), `sent` per task, `ack` per result taken (`used` or not), `applied` per
optimizer step (the round's parts, the version it made), `checkpoint` per save. Lines are written
as they come (`AppendFile`, one write each), so a kill -9 loses at most the line being written;
the next writer starts on a fresh line, so that torn line costs nothing else. A full disk stops
no coordinator: the lines wait in memory and are written once it takes them again. Flushed is not on disk: `sync()` is for
the coordinator to call right before it saves a checkpoint, so that a power loss cannot leave a
checkpoint newer than the ledger (the audit would miss the steps in between).

`audit` replays the file into the lineage of the final model: a restart from a checkpoint at
version V undoes every step the earlier processes applied after V (they are recomputed from the
replanned parts). Over that lineage, each training sample of each finished epoch must appear
exactly once: `lost` counts the samples the final model never saw, `duplicates` the extra
appearances. Pure: records in, counts out.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

log = logging.getLogger("idlegrad.coordinator.ledger")


# json.dumps escapes every quote inside a string, so this only ever occurs where a record begins
RECORD_START = '{"event": '


class AppendFile:
    """A file of lines appended to, that a full disk (or any refused write) never stops: a line
    the disk refuses waits in memory, at most MAX_PENDING of them (the oldest dropped past that,
    and counted), and goes out ahead of the next line once the disk takes it again. One line to
    `report(kind, text, worker, level)` (the coordinator's events) when writing fails, one when
    it works again. A write cut short leaves a torn line; the next begins on a fresh one."""

    MAX_PENDING = 100_000

    def __init__(self, path: str, what: str, report: Optional[Callable] = None):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.what, self.report = path, what, report
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: deque[bytes] = deque()
        self._torn = not _ends_a_line(path)  # a line torn by a kill -9: ours must not continue it
        self.failing: Optional[str] = None  # why the last write failed, until one works
        self.dropped = 0  # lines lost for good: more pending than MAX_PENDING

    def write(self, line: str) -> None:
        if len(self._pending) >= self.MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append(line.encode("utf-8"))
        self._flush()

    def _flush(self) -> bool:
        while self._pending:
            data = (b"\n" if self._torn else b"") + self._pending[0]
            try:
                written = os.write(self._fd, data)
            except OSError as exc:
                self._failed(exc)
                return False
            if written < len(data):
                self._torn = written > 0 or self._torn
                self._failed(OSError(f"{written} of {len(data)} bytes written"))
                return False
            self._torn = False
            self._pending.popleft()
        if self.failing is not None:
            self.failing = None
            self._report(logging.WARNING, f"{self.what} {self.path} is written again"
                         + (f"; {self.dropped} lines were lost" if self.dropped else ""))
        return True

    def _failed(self, exc: OSError) -> None:
        reason = exc.strerror or str(exc)
        if self.failing is None:
            self._report(logging.ERROR, f"cannot write {self.what} {self.path} ({reason}): "
                         "training goes on, its lines are kept in memory and written later")
        self.failing = reason

    def _report(self, level: int, text: str) -> None:
        if self.report is not None:
            self.report("disk", text, None, level)
        else:
            log.log(level, "%s", text)

    def sync(self) -> None:
        """Put every line written so far on disk (fsync); what is pending stays pending."""
        if self._flush():
            try:
                os.fsync(self._fd)
            except OSError as exc:
                self._failed(exc)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._flush()
        os.close(self._fd)


class LedgerWriter:
    def __init__(self, path: str, instance: str, report: Optional[Callable] = None):
        self._file = AppendFile(path, "the ledger", report)
        self.instance = instance

    def write(self, event: str, **fields) -> None:
        # `event` first: a record always begins with RECORD_START
        self._file.write(json.dumps({"event": event, "instance": self.instance, **fields}) + "\n")

    def sync(self) -> None:
        """Put every record written so far on disk (fsync)."""
        self._file.sync()

    def close(self) -> None:
        self._file.close()


def _ends_a_line(path: str) -> bool:
    """Whether the file is empty or its last byte ends a line."""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() == 0:
            return True
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def read(path: str) -> list[dict]:
    """The records in the file, less any torn by a kill -9. A ledger written before writers began
    on a fresh line may hold a torn record and the next one on one line: that one is kept."""
    records = []
    with open(path) as fh:
        for line in fh:
            try:
                records.append(json.loads(line))
                continue
            except json.JSONDecodeError:
                pass
            for piece in line.split(RECORD_START)[1:]:
                try:
                    records.append(json.loads(RECORD_START + piece))
                except json.JSONDecodeError:  # the torn one
                    continue
    return records


@dataclass(frozen=True)
class Audit:
    sent: int  # tasks handed out
    acknowledged: int  # results taken
    used: int  # of them, used in a round
    applied_rounds: int  # steps in the final lineage
    undone_rounds: int  # steps lost with a crashed process, recomputed after its restart
    restarts: int
    samples: int  # sample appearances in the lineage
    lost: int  # samples of the finished epochs the final model never saw
    duplicates: int  # extra appearances of samples

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def audit(records: Iterable[dict], train_size: int, epochs: Optional[int]) -> Audit:
    """The ledger's lineage checked against `epochs` full passes over `train_size` samples
    (`epochs` None: only duplicates are counted, `lost` is 0)."""
    lineage: list[tuple[int, list]] = []  # (version made, parts)
    sent = acked = used = undone = starts = 0
    for record in records:
        event = record.get("event")
        if event == "start":
            starts += 1
            resumed = int(record.get("version", 0))
            kept = [(v, parts) for v, parts in lineage if v <= resumed]
            undone += len(lineage) - len(kept)
            lineage = kept
        elif event == "applied":
            lineage.append((int(record["version"]), record["parts"]))
        elif event == "sent":
            sent += 1
        elif event == "ack":
            acked += 1
            used += bool(record.get("used"))
    seen: Counter[tuple[int, int]] = Counter()
    for _, parts in lineage:
        for epoch, offset, count in parts:
            for i in range(offset, offset + count):
                seen[(epoch, i)] += 1
    duplicates = sum(n - 1 for n in seen.values() if n > 1)
    lost = 0
    if epochs is not None:
        lost = sum(1 for e in range(epochs) for i in range(train_size) if (e, i) not in seen)
    return Audit(sent=sent, acknowledged=acked, used=used, applied_rounds=len(lineage),
                 undone_rounds=undone, restarts=max(0, starts - 1),
                 samples=sum(seen.values()), lost=lost, duplicates=duplicates)
