"""`idlegrad data pack` and `idlegrad data publish`: what they write, and bad input as one line."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from idlegrad.common.blobs import BlobFolder
from idlegrad.common.sharded import ShardedDataset


def test_pack_npz_then_publish(run_cli, tmp_path):
    x = np.random.default_rng(1).standard_normal((50, 4)).astype(np.float32)
    y = np.arange(50, dtype=np.int64)
    np.savez(tmp_path / "d.npz", inputs=x, targets=y)
    result = run_cli(["data", "pack", str(tmp_path / "d.npz"), "--out", str(tmp_path / "p"),
                      "--shard-mb", "0.0005"])
    assert result.code == 0, result.err
    name = result.out.split()[0]
    assert hashlib.sha256((tmp_path / "p" / "manifest.json").read_bytes()).hexdigest() == name
    assert "50 samples in 3 shards of 21 samples" in result.out
    result = run_cli(["data", "publish", str(tmp_path / "p"), "--to", str(tmp_path / "m")])
    assert result.code == 0, result.err
    assert result.out.startswith(name) and "4 blobs copied" in result.out
    manifest_blob = tmp_path / "m" / "blobs" / name[:2] / name
    assert manifest_blob.is_file()
    ds = ShardedDataset(str(tmp_path / "p" / "manifest.json"), BlobFolder(str(tmp_path / "m")))
    assert torch.equal(ds[49][0], torch.from_numpy(x[49]))


def test_pack_npy_pair_corpus_and_job(run_cli, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((6, 2), np.float16))
    np.save(tmp_path / "y.npy", np.zeros(6, np.int32))
    result = run_cli(["data", "pack", str(tmp_path / "x.npy"), "--targets", str(tmp_path / "y.npy"),
                      "--out", str(tmp_path / "a")])
    assert result.code == 0 and "6 samples in 1 shard of" in result.out
    x, y = ShardedDataset(str(tmp_path / "a" / "manifest.json"))[5]
    assert x.dtype == torch.float16 and x.shape == (2,) and y.dtype == torch.int32 and y.shape == ()
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "t.txt").write_text("abcdefgh" * 10)
    result = run_cli(["data", "pack", str(tmp_path / "txt"), "--window", "8",
                      "--out", str(tmp_path / "b")])
    assert result.code == 0 and "10 samples" in result.out
    result = run_cli(["data", "pack", "--job", "synthetic", "--job-arg", "samples=200",
                      "--out", str(tmp_path / "c")])
    assert result.code == 0 and "180 samples" in result.out  # synthetic keeps 10% for testing


@pytest.mark.parametrize("argv, needle", [
    (["data", "pack", "--out", "OUT"], "give SOURCE or --job SPEC"),
    (["data", "pack", "SRC.npz", "--job", "digits", "--out", "OUT"], "give SOURCE or --job SPEC"),
    (["data", "pack", "NOPE", "--out", "OUT"], "no such file or folder"),
    (["data", "pack", "NOPE.npz", "--out", "OUT"], "no such file"),
    (["data", "pack", "TXT", "--out", "OUT"], "give --window N"),
    (["data", "pack", "X.npy", "--out", "OUT"], "needs --targets"),
    (["data", "pack", "BAD.npz", "--out", "OUT"], "needs arrays named inputs and targets"),
    (["data", "pack", "OBJ.npy", "--targets", "OBJ.npy", "--out", "OUT"], "cannot read numpy"),
    (["data", "pack", "TXT", "--window", "0", "--out", "OUT"], "must be positive"),
    (["data", "pack", "--job", "no_such_job", "--out", "OUT"], "unknown job"),
    (["data", "publish", "TXT", "--to", "OUT"], "no manifest.json"),
    (["data", "publish", "TXT"], "--to"),
    (["data", "pack", "X.npz", "--out", "X.npy"], "X.npy: File exists"),
])
def test_bad_input_is_one_line(run_cli, tmp_path, argv, needle):
    (tmp_path / "TXT").mkdir()
    (tmp_path / "TXT" / "a").write_text("x" * 100)
    np.savez(tmp_path / "BAD.npz", x=np.zeros(3))
    np.save(tmp_path / "X.npy", np.zeros(3))
    np.savez(tmp_path / "X.npz", inputs=np.zeros(3), targets=np.zeros(3))
    np.save(tmp_path / "OBJ.npy", np.array([{}, []], dtype=object), allow_pickle=True)
    argv = [str(tmp_path / a) if a.isupper() or a.endswith((".npz", ".npy")) else a for a in argv]
    result = run_cli(argv)
    assert result.code == 2
    assert needle in result.one_line_error()
    assert result.out == ""
