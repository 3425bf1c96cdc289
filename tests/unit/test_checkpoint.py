"""Checkpoints: a reader sees the old one or the new one, never half; no pickled code loads."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from idlegrad.common.errors import CheckpointError
from idlegrad.coordinator import checkpoint


class Payload:
    """An arbitrary object: weights_only loading must refuse to unpickle it."""

    def __init__(self):
        self.value = 42

    def __reduce__(self):  # what a hostile file would do
        return (os.getcwd, ())


def make_state():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {
        "job": "digits", "fingerprint": "0123abcd", "version": 7,
        "params": torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(),
        "optimizer": opt.state_dict(),
        "sampler": {"epoch": 1, "offset": 32, "replan": [[[1, 0, 16]], [[0, 16, 8], [0, 24, 8]]]},
        "seed": 3, "samples": 1234, "next_id": 99, "elapsed": 12.5,
        "metrics": {"accuracy": 0.5, "loss": 1.25},
    }


def listing(d):
    return sorted(os.listdir(d))


def test_load_absent(tmp_path):
    assert checkpoint.load(str(tmp_path)) is None
    assert checkpoint.load(str(tmp_path / "not-even-a-dir")) is None


def test_round_trip(tmp_path):
    d = str(tmp_path / "ckpt")  # created on demand
    state = make_state()
    path = checkpoint.save(d, state)
    assert path == os.path.join(d, checkpoint.FILENAME) == checkpoint.path_in(d)
    assert listing(d) == [checkpoint.FILENAME]
    got = checkpoint.load(d)
    assert got["format"] == checkpoint.FORMAT
    assert torch.equal(got["params"], state["params"])
    for key in ("job", "fingerprint", "version", "sampler", "seed", "samples", "next_id",
                "elapsed", "metrics"):
        assert got[key] == state[key], key
    opt = got["optimizer"]
    assert opt["param_groups"] == state["optimizer"]["param_groups"]
    for i, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(opt["state"][i][k], v)
    # the optimizer state loads into a fresh optimizer
    model = nn.Linear(4, 3)
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    fresh.load_state_dict(opt)


def test_save_replaces(tmp_path):
    d = str(tmp_path)
    checkpoint.save(d, {"version": 1, "params": torch.zeros(3)})
    checkpoint.save(d, {"version": 2, "params": torch.ones(3)})
    got = checkpoint.load(d)
    assert got["version"] == 2 and torch.equal(got["params"], torch.ones(3))
    assert listing(d) == [checkpoint.FILENAME]


def test_failed_save_keeps_the_old_checkpoint_and_leaves_no_temp(tmp_path, monkeypatch):
    d = str(tmp_path)
    checkpoint.save(d, {"version": 1, "params": torch.arange(4.0)})
    real_save = torch.save

    def half_then_fail(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a checkpoint")
        f.flush()
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(d, {"version": 2, "params": torch.zeros(4)})
    monkeypatch.setattr(torch, "save", real_save)
    assert listing(d) == [checkpoint.FILENAME]
    got = checkpoint.load(d)
    assert got["version"] == 1 and torch.equal(got["params"], torch.arange(4.0))


def test_interrupted_save_leaves_no_temp(tmp_path, monkeypatch):
    d = str(tmp_path)

    def interrupted(obj, f, *a, **k):
        f.write(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(d, {"version": 1})
    assert listing(d) == []
    monkeypatch.undo()
    assert checkpoint.load(d) is None


def test_failed_rename_leaves_no_temp(tmp_path, monkeypatch):
    d = str(tmp_path)
    checkpoint.save(d, {"version": 1})

    def no_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(OSError):
        checkpoint.save(d, {"version": 2})
    monkeypatch.undo()
    assert listing(d) == [checkpoint.FILENAME]
    assert checkpoint.load(d)["version"] == 1


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", b"\x80\x04K\x01.",
                                     b"PK\x03\x04" + b"\x00" * 100])
def test_not_a_checkpoint(tmp_path, content):
    (tmp_path / checkpoint.FILENAME).write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(str(tmp_path))
    assert checkpoint.FILENAME in str(e.value)
    assert "\n" not in str(e.value)


def test_truncated_checkpoint(tmp_path):
    checkpoint.save(str(tmp_path), {"params": torch.randn(1000)})
    path = tmp_path / checkpoint.FILENAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        checkpoint.load(str(tmp_path))


@pytest.mark.parametrize("obj", [{"params": torch.zeros(2)}, {"format": 2}, {"format": "1"},
                                 [1, 2, 3], torch.zeros(3), "format"])
def test_torch_file_of_the_wrong_shape(tmp_path, obj):
    torch.save(obj, tmp_path / checkpoint.FILENAME)
    with pytest.raises(CheckpointError):
        checkpoint.load(str(tmp_path))


def test_weights_only_refuses_pickled_objects(tmp_path):
    path = tmp_path / checkpoint.FILENAME
    torch.save({"format": checkpoint.FORMAT, "payload": Payload()}, path)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(str(tmp_path))
    assert "\n" not in str(e.value)  # the CLI prints it as one line
    torch.save(Payload(), path)
    with pytest.raises(CheckpointError):
        checkpoint.load(str(tmp_path))
    # a plain module object is code too
    torch.save({"format": checkpoint.FORMAT, "model": nn.Linear(2, 2)}, path)
    with pytest.raises(CheckpointError):
        checkpoint.load(str(tmp_path))


# temporary files orphaned by a crash mid-save ------------------------------------------------

ORPHANS = [".checkpoint-k2j_x9a1.tmp", ".checkpoint-Q.tmp"]  # as mkstemp names them
LOOKALIKES = [".checkpoint-k2j_x9a1.tmp.keep", "checkpoint-k2j_x9a1.tmp", ".checkpoint-.tmp",
              ".checkpoint-a b.tmp", ".checkpoint-k2j.tmpx", "notes.tmp", "x.checkpoint-ab.tmp"]


def litter(d):
    os.makedirs(d, exist_ok=True)
    for name in ORPHANS + LOOKALIKES:
        with open(os.path.join(d, name), "wb") as fh:
            fh.write(b"half a checkpoint")
    os.mkdir(os.path.join(d, ".checkpoint-folder1.tmp"))  # not a file save makes
    outside = os.path.join(os.path.dirname(d), "kept.bin")
    with open(outside, "wb") as fh:
        fh.write(b"not ours")
    os.symlink(outside, os.path.join(d, ".checkpoint-link1.tmp"))
    return outside


NOT_OURS = LOOKALIKES + [".checkpoint-folder1.tmp", ".checkpoint-link1.tmp"]


@pytest.mark.parametrize("how", ["save", "load", "load-empty"])
def test_orphaned_temporary_files_are_removed_and_nothing_else(tmp_path, how):
    d = str(tmp_path / "ckpt")
    if how != "load-empty":
        checkpoint.save(d, {"version": 1, "params": torch.zeros(3)})
    outside = litter(d)
    if how == "save":
        checkpoint.save(d, {"version": 2, "params": torch.ones(3)})
    else:
        checkpoint.load(d)
    expected = NOT_OURS + ([] if how == "load-empty" else [checkpoint.FILENAME])
    assert listing(d) == sorted(expected)
    assert os.path.exists(outside)
    if how != "load-empty":
        assert checkpoint.load(d)["version"] == (2 if how == "save" else 1)


def test_a_save_still_being_written_here_is_not_an_orphan(tmp_path, monkeypatch):
    """A load (or another save) while this process writes a checkpoint leaves its file alone."""
    d = str(tmp_path)
    real_save = torch.save
    seen = []

    def save_while_cleaning(obj, fh, *args, **kwargs):
        seen.append(listing(d))
        checkpoint.load(d)  # cleans the folder mid-save
        seen.append(listing(d))
        real_save(obj, fh, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save_while_cleaning)
    checkpoint.save(d, {"version": 3, "params": torch.ones(2)})
    monkeypatch.undo()
    assert seen[0] == seen[1] and len(seen[0]) == 1 and seen[0][0].startswith(".checkpoint-")
    assert listing(d) == [checkpoint.FILENAME]
    assert checkpoint.load(d)["version"] == 3
