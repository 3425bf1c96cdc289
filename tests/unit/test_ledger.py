"""The ledger's audit: the final model's lineage across restarts, lost and duplicated samples."""

from __future__ import annotations

import json
import os

from idlegrad.coordinator.ledger import LedgerWriter, audit, read


def applied(version, *parts):
    return {"event": "applied", "version": version, "parts": [list(p) for p in parts]}


def test_one_clean_pass():
    records = [{"event": "start", "version": 0}, {"event": "sent"}, {"event": "ack", "used": True},
               applied(1, (0, 0, 6)), applied(2, (0, 6, 4))]
    a = audit(records, train_size=10, epochs=1)
    assert (a.lost, a.duplicates, a.applied_rounds, a.sent, a.acknowledged, a.used) == (0, 0, 2, 1, 1, 1)


def test_missing_and_repeated_samples_are_counted():
    a = audit([{"event": "start", "version": 0}, applied(1, (0, 0, 6)), applied(2, (0, 4, 4))],
              train_size=10, epochs=1)
    assert a.lost == 2 and a.duplicates == 2


def test_a_restart_undoes_the_steps_after_its_checkpoint():
    records = [{"event": "start", "version": 0}, applied(1, (0, 0, 4)), applied(2, (0, 4, 4)),
               {"event": "checkpoint", "version": 2}, applied(3, (0, 8, 2)),  # lost in the crash
               {"event": "start", "version": 2}, applied(3, (0, 8, 2)), applied(4, (1, 0, 10))]
    a = audit(records, train_size=10, epochs=2)
    assert (a.lost, a.duplicates, a.undone_rounds, a.restarts) == (0, 0, 1, 1)
    # Without the restart's undo the redone step would be a duplicate.
    assert audit([r for r in records if r["event"] != "start"], 10, 2).duplicates == 2


def test_writer_and_reader(tmp_path):
    path = str(tmp_path / "d" / "ledger.jsonl")
    w = LedgerWriter(path, "i1")
    w.write("start", version=0)
    w.write("applied", version=1, parts=[[0, 0, 3]])
    w.close()
    with open(path, "a") as fh:
        fh.write('{"event": "appl')  # cut by a kill -9
    records = read(path)
    assert [r["event"] for r in records] == ["start", "applied"]
    assert records[0]["instance"] == "i1"
    assert audit(records, 3, 1).lost == 0


TORN = '{"event": "applied", "instance": "first", "vers'  # a record cut by a kill -9


def crashed_run(path):
    """A process that applied three steps, checkpointed at 2, and was killed mid-line."""
    w = LedgerWriter(path, "first")
    w.write("start", version=0)
    w.write("applied", version=1, parts=[[0, 0, 4]])
    w.write("applied", version=2, parts=[[0, 4, 4]])
    w.write("checkpoint", version=2)
    w.write("applied", version=3, parts=[[0, 8, 2]])  # lost with the crash: redone below
    w.close()
    with open(path, "a") as fh:
        fh.write(TORN)


def test_a_line_torn_by_a_kill_costs_only_itself(tmp_path):
    """The next process's `start` lands on a line of its own: read, it undoes the lost step."""
    path = str(tmp_path / "ledger.jsonl")
    crashed_run(path)
    w = LedgerWriter(path, "second")
    w.write("start", version=2)
    w.write("applied", version=3, parts=[[0, 8, 2]])
    w.close()
    with open(path) as fh:
        lines = fh.read().splitlines()
    assert lines[5] == TORN and json.loads(lines[6])["instance"] == "second"
    records = read(path)
    assert [(r["event"], r["instance"]) for r in records][-2:] == [("start", "second"),
                                                                    ("applied", "second")]
    assert len(records) == 7
    a = audit(records, train_size=10, epochs=1)
    assert (a.duplicates, a.lost, a.restarts, a.undone_rounds) == (0, 0, 1, 1)


def test_a_record_written_after_a_torn_one_on_the_same_line_is_read(tmp_path):
    """Ledgers from before writers began on a fresh line: only the torn record is skipped."""
    path = str(tmp_path / "ledger.jsonl")
    crashed_run(path)
    with open(path, "a") as fh:
        fh.write('{"event": "start", "instance": "second", "version": 2}\n'
                 '{"event": "applied", "instance": "second", "version": 3, "parts": [[0, 8, 2]]}\n')
    records = read(path)
    assert [r["instance"] for r in records if r["event"] == "start"] == ["first", "second"]
    assert audit(records, train_size=10, epochs=1).duplicates == 0


def test_a_writer_on_an_intact_file_adds_no_blank_line(tmp_path):
    path = str(tmp_path / "ledger.jsonl")
    for instance in ("a", "b"):
        w = LedgerWriter(path, instance)
        w.write("start", version=0)
        w.close()
    with open(path) as fh:
        assert fh.read().count("\n") == 2


def test_sync_puts_the_records_on_disk(tmp_path, monkeypatch):
    path = str(tmp_path / "ledger.jsonl")
    w = LedgerWriter(path, "i1")
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        with open(path) as fh:  # what the disk is asked to keep
            synced.append((os.fstat(fd).st_ino, fh.read()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    w.write("applied", version=1, parts=[[0, 0, 3]])
    w.sync()
    w.close()
    assert len(synced) == 1
    inode, text = synced[0]
    assert inode == os.stat(path).st_ino and '"applied"' in text
