"""The ledger's audit: the final model's lineage across restarts, lost and duplicated samples."""

from __future__ import annotations

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
