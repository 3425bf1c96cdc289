"""The real built-in jobs, `lm` and `resnet`, on small data made in their formats."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from idlegrad.common import builtin_jobs
from idlegrad.common.errors import JobError
from idlegrad.common.job import build, evaluate, load_job, make_optimizer
from idlegrad.coordinator.target import Target


@pytest.fixture
def pack_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "idlegrad" / "packs"


def write_corpus(root, files: int = 120, size: int = 300) -> dict[str, bytes]:
    rng = np.random.RandomState(0)
    texts = {}
    for k in range(files):
        rel = f"pkg{k % 3}/mod{k}.txt"
        body = (f"# file {k}\n" + "def f(x):\n    return x + %d\n" % k) * (size // 30)
        texts[rel] = body.encode() + bytes(rng.randint(97, 123, 7).tolist())
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as fh:
            fh.write(texts[rel])
    return texts


def train_steps(job, built, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = built.model.module
    opt = make_optimizer(job, model)
    batch = torch.stack([built.train[i] for i in range(job.batch_size)])
    first = last = None
    for _ in range(steps):
        loss = job.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = float(loss.detach()) if first is None else first
        last = float(loss.detach())
    return first, last


def test_lm_packs_once_holds_out_files_and_learns(tmp_path, pack_cache, monkeypatch):
    from idlegrad.common import blobs

    packed = []
    real_pack = blobs.pack_corpus
    monkeypatch.setattr(blobs, "pack_corpus", lambda *a, **k: packed.append(a) or real_pack(*a, **k))
    corpus = tmp_path / "corpus"
    texts = write_corpus(str(corpus))
    job = load_job("lm", {"corpus": str(corpus), "context": 16, "batch_size": 8})
    built = build(job)
    again = build(job)
    assert built.fingerprint == again.fingerprint
    assert len(packed) == 1  # the second build reused the pack
    assert len(os.listdir(pack_cache)) == 1
    held = sorted(builtin_jobs.held_out_files(sorted(texts)))
    kept = sorted(set(texts) - set(held))
    assert held and kept
    window = 17
    assert len(built.train) == sum(len(texts[r]) for r in kept) // window
    assert len(built.test) == sum(len(texts[r]) for r in held) // window
    # the held-out windows are the held-out files' bytes, and none of the training windows are
    held_bytes = b"".join(texts[r] for r in held)
    assert bytes(built.test[0].numpy()) == held_bytes[:window]
    assert bytes(built.test[len(built.test) - 1].numpy()) in held_bytes
    kept_bytes = b"".join(texts[r] for r in kept)
    assert bytes(built.train[len(built.train) - 1].numpy()) in kept_bytes
    first, last = train_steps(job, built, 30)
    assert last < first * 0.7
    metrics = evaluate(job, built.model.module, built.test)
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / np.log(2))


def test_lm_with_data_reads_the_pack_from_a_store_not_the_corpus(tmp_path, pack_cache):
    from idlegrad.common.blobs import BlobFolder, load_manifest

    corpus = tmp_path / "corpus"
    write_corpus(str(corpus))
    local = load_job("lm", {"corpus": str(corpus), "context": 16})
    pack_dir = local.pack()
    manifest = load_manifest(os.path.join(pack_dir, "manifest.json"))
    local_fingerprint = build(local).fingerprint
    os.rename(corpus, tmp_path / "gone")
    remote = load_job("lm", {"corpus": str(corpus), "context": 16, "data": manifest.sha256})
    assert remote.pack is None
    built = build(remote, store=BlobFolder(pack_dir))
    assert built.fingerprint == local_fingerprint
    with pytest.raises(JobError, match="manifest's sha256"):
        load_job("lm", {"data": "not-a-hash"})


def test_lm_corpus_change_is_a_new_fingerprint(tmp_path, pack_cache):
    corpus = tmp_path / "corpus"
    write_corpus(str(corpus))
    job = load_job("lm", {"corpus": str(corpus), "context": 16})
    before = build(job).fingerprint
    with open(corpus / "pkg0" / "mod0.txt", "ab") as fh:
        fh.write(b"one more line of text, long enough to add windows\n" * 3)
    assert build(job).fingerprint != before


def test_lm_bad_arguments_are_one_line(tmp_path, pack_cache):
    with pytest.raises(JobError, match="size must be one of"):
        load_job("lm", {"size": "huge"})
    with pytest.raises(JobError, match="not a folder"):
        build(load_job("lm", {"corpus": str(tmp_path / "missing")}))


def test_bits_per_byte_is_lower_is_better():
    target = Target.parse("bits_per_byte=2.0")
    assert target.reached({"bits_per_byte": 1.9}) and not target.reached({"bits_per_byte": 2.1})


def write_cifar(folder, counts=(40, 40), test=30, seed=0):
    rng = np.random.RandomState(seed)
    os.makedirs(folder, exist_ok=True)
    made = {}
    for name, n in [(f"data_batch_{i + 1}.bin", c) for i, c in enumerate(counts)] + [("test_batch.bin", test)]:
        labels = rng.randint(0, 10, n).astype(np.uint8)
        pixels = rng.randint(0, 256, (n, 3072)).astype(np.uint8)
        # the class shows in the red channel's mean, so the data is learnable
        pixels[:, :1024] = (labels[:, None] * 25).astype(np.uint8)
        np.concatenate([labels[:, None], pixels], axis=1).tofile(os.path.join(folder, name))
        made[name] = (labels, pixels)
    return made


def test_resnet_reads_cifar_binary_batches(tmp_path):
    made = write_cifar(str(tmp_path / "cifar"))
    job = load_job("resnet", {"data": str(tmp_path / "cifar"), "batch_size": 16, "width": 4})
    built = build(job)
    assert len(built.train) == 80 and len(built.test) == 30
    x, y = built.train[41]
    labels, pixels = made["data_batch_2.bin"]
    assert x.shape == (3, 32, 32) and x.dtype == torch.uint8
    assert int(y) == int(labels[1]) and np.array_equal(x.numpy().reshape(-1), pixels[1])
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in built.model.module.modules())


def test_resnet_refuses_what_is_not_cifar(tmp_path):
    folder = tmp_path / "bad"
    write_cifar(str(folder))
    with open(folder / "data_batch_1.bin", "ab") as fh:
        fh.write(b"xx")
    with pytest.raises(JobError, match="not CIFAR-10 binary"):
        build(load_job("resnet", {"data": str(folder)}))
    with pytest.raises(JobError, match="needs CIFAR-10 binary batches"):
        build(load_job("resnet", {"data": str(tmp_path)}))


def test_resnet_on_digits_learns():
    job = load_job("resnet", {"batch_size": 32, "width": 8})
    built = build(job)
    x, y = built.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.uint8
    model = built.model.module
    opt = make_optimizer(job, model)
    batch = [torch.stack([built.train[i][0] for i in range(64)]),
             torch.stack([built.train[i][1] for i in range(64)])]
    losses = []
    for _ in range(25):
        loss = job.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] * 0.5
