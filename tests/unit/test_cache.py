"""The worker's blob cache (worker/cache.py) against a real HTTP mirror on loopback: caps, LRU,
corruption, resume, one download per blob, lying and stalling mirrors, the owner's network caps."""

from __future__ import annotations

import errno
import hashlib
import os
import threading

import numpy as np
import pytest
import torch

from idlegrad.common.blobs import pack_arrays, publish
from idlegrad.common.sharded import ShardedDataset
from idlegrad.worker.cache import (BlobCache, CacheError, CacheTooSmall, DailyAllowance,
                                   HttpSource, RateLimiter, SourceHealth, TransferCapReached,
                                   choose_evictions)

from idlegrad.worker import cache as cache_module

from .blob_mirror import Mirror

SHARD = 1000  # bytes of one shard below: 125 samples of float32[1] + int32[1]


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += seconds


def publish_four_shards(tmp_path):
    """A mirror folder holding a data set of 4 shards of SHARD bytes; (manifest, folder)."""
    x = np.arange(500, dtype=np.float32).reshape(500, 1)
    manifest = pack_arrays(x, np.arange(500, dtype=np.int32).reshape(500, 1),
                           str(tmp_path / "pack"), shard_mb=SHARD / 2**20)
    assert [s.size for s in manifest.shards] == [SHARD] * 4
    publish(str(tmp_path / "pack"), str(tmp_path / "mirror"))
    return manifest, str(tmp_path / "mirror")


@pytest.fixture
def published(tmp_path):
    return publish_four_shards(tmp_path)


def cache_for(tmp_path, mirrors, cap=10 * SHARD, clock=None, timeout_s=5.0, **kw):
    clock = clock or Clock()
    return BlobCache(str(tmp_path / "cache"), cap, [HttpSource(m.url, timeout_s) for m in mirrors],
                     clock=clock, sleep=clock.sleep, **kw)


def test_a_dataset_reads_through_the_cache_and_each_blob_is_fetched_once(tmp_path, published):
    manifest, folder = published
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror])
        ds = ShardedDataset(manifest, cache)
        assert [int(ds[i][1]) for i in range(0, 500, 7)] == list(range(0, 500, 7))
        again = ShardedDataset.from_store(manifest.sha256, cache)  # the manifest by name, too
        assert torch.equal(again[499][0], torch.tensor([499.0]))
        assert cache.downloads == 5
        assert all(len(mirror.gets_of(s.sha256)) == 1 for s in manifest.shards)


def test_the_cap_evicts_the_least_recently_used(tmp_path, published):
    manifest, folder = published
    a, b, c, d = (s.sha256 for s in manifest.shards)
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], cap=3 * SHARD, clock=clock)
        for name in (a, b, c):
            cache.path_of(name, SHARD)
            clock.now += 10
        cache.path_of(a, SHARD)  # a is used again: b is now the oldest
        clock.now += 10
        cache.path_of(d, SHARD)
        assert [cache.has(n) for n in (a, b, c, d)] == [True, False, True, True]
        assert cache.used_bytes() <= 3 * SHARD and cache.evicted == 1


def test_a_cap_below_one_blob_is_one_line_and_no_download(tmp_path, published):
    manifest, folder = published
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], cap=SHARD - 1)
        with pytest.raises(CacheTooSmall) as caught:
            cache.path_of(manifest.shards[0].sha256, SHARD)
        assert "\n" not in str(caught.value) and "raise cache_max_gb" in str(caught.value)
        assert mirror.requests == []


def test_a_blob_corrupted_on_disk_is_detected_by_the_next_process_and_fetched_again(tmp_path,
                                                                                    published):
    manifest, folder = published
    sha = manifest.shards[2].sha256
    with Mirror(folder) as mirror:
        path = cache_for(tmp_path, [mirror]).path_of(sha, SHARD)
        with open(path, "r+b") as fh:  # same size, one byte flipped: only the hash can tell
            fh.seek(500)
            byte = fh.read(1)
            fh.seek(500)
            fh.write(bytes([byte[0] ^ 1]))
        restarted = cache_for(tmp_path, [mirror])  # its first hit checks the blob
        path = restarted.path_of(sha, SHARD)
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == sha
        assert len(mirror.gets_of(sha)) == 2


def test_a_blob_is_hashed_at_download_and_not_again_on_each_hit(tmp_path, published, monkeypatch):
    manifest, folder = published
    sha = manifest.shards[1].sha256
    hashed = []
    real = cache_module.sha256_file
    monkeypatch.setattr(cache_module, "sha256_file", lambda p: hashed.append(p) or real(p))
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror])
        for _ in range(3):
            cache.path_of(sha, SHARD)
        assert len(hashed) == 1 and cache.hits == 2  # the download's check, then none
        cache_for(tmp_path, [mirror]).path_of(sha, SHARD)  # another process checks it once
        assert len(hashed) == 2 and len(mirror.gets_of(sha)) == 1


def test_a_download_killed_half_way_resumes_with_a_range_request(tmp_path, published):
    manifest, folder = published
    sha = manifest.shards[1].sha256
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], clock=clock)
        mirror.cut_after = 400
        with pytest.raises(CacheError, match="could not be fetched"):
            cache.path_of(sha, SHARD)
        assert os.path.getsize(tmp_path / "cache" / "partial" / sha) == 400
        mirror.cut_after = None
        with pytest.raises(CacheError, match="skipped after a recent failure"):
            cache.path_of(sha, SHARD)  # benched: no second request at once
        clock.now += 61
        path = cache.path_of(sha, SHARD)
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == sha
        assert mirror.gets_of(sha) == ["", "bytes=400-"]
        assert not os.path.exists(tmp_path / "cache" / "partial" / sha)


def test_one_download_per_blob_with_two_threads_asking(tmp_path, published):
    manifest, folder = published
    sha = manifest.shards[0].sha256
    with Mirror(folder) as mirror:
        mirror.stall_s = 0.3  # both threads ask while the first download is under way
        cache = BlobCache(str(tmp_path / "cache"), 10 * SHARD, [HttpSource(mirror.url)])
        paths, barrier = [], threading.Barrier(2)

        def ask():
            barrier.wait()
            paths.append(cache.path_of(sha, SHARD))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        [t.start() for t in threads]
        [t.join(10) for t in threads]
        assert len(paths) == 2 and paths[0] == paths[1]
        assert len(mirror.gets_of(sha)) == 1 and cache.downloads == 1


def test_a_lying_mirror_is_skipped_for_a_while_at_the_cost_of_one_retry(tmp_path, published):
    manifest, folder = published
    with Mirror(folder) as liar, Mirror(folder) as honest:
        liar.lie = True
        cache = cache_for(tmp_path, [liar, honest])
        for shard in manifest.shards:
            path = cache.path_of(shard.sha256, shard.size)
            assert hashlib.sha256(open(path, "rb").read()).hexdigest() == shard.sha256
        assert len(liar.requests) == 1  # tried once, then benched
        assert len(honest.requests) == 4


def test_a_stalling_mirror_times_out_and_the_next_source_serves(tmp_path, published):
    manifest, folder = published
    with Mirror(folder) as slow, Mirror(folder) as fast:
        slow.stall_s = 2.0
        cache = cache_for(tmp_path, [slow, fast], timeout_s=0.3)
        cache.path_of(manifest.shards[0].sha256, SHARD)
        cache.path_of(manifest.shards[1].sha256, SHARD)
        assert len(slow.requests) == 1 and len(fast.requests) == 2


def test_a_mirror_that_ignores_range_restarts_from_zero(tmp_path, published):
    manifest, folder = published
    sha = manifest.shards[3].sha256
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], clock=clock)
        mirror.cut_after = 300
        with pytest.raises(CacheError):
            cache.path_of(sha, SHARD)
        mirror.cut_after, mirror.ignore_range = None, True
        clock.now += 61
        path = cache.path_of(sha, SHARD)
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == sha


def test_the_download_rate_cap_paces_the_fetch(tmp_path, published):
    manifest, folder = published
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], clock=clock, rate_bytes_per_s=100.0)
        for shard in manifest.shards[:2]:
            cache.path_of(shard.sha256, SHARD)
    # 2000 bytes at 100 B/s: 20 s, less the first chunk (one per blob here), which goes at once
    assert clock.slept == pytest.approx(10.0)


def test_the_daily_transfer_cap_stops_and_resumes_the_next_day(tmp_path, published):
    manifest, folder = published
    sha = manifest.shards[1].sha256
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], clock=clock, daily_bytes=1500)
        cache.path_of(manifest.shards[0].sha256, SHARD)
        with pytest.raises(TransferCapReached, match="transfer cap"):
            cache.path_of(sha, SHARD)
        assert os.path.getsize(tmp_path / "cache" / "partial" / sha) == 500
        # a restart keeps the count: the cap is not a per-process one
        restarted = cache_for(tmp_path, [mirror], clock=clock, daily_bytes=1500)
        with pytest.raises(TransferCapReached):
            restarted.path_of(sha, SHARD)
        clock.now += 86400
        path = restarted.path_of(sha, SHARD)
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == sha
        assert mirror.gets_of(sha)[-1] == "bytes=500-"


def test_a_spent_cap_asks_no_source_and_evicts_nothing_until_the_next_day(tmp_path, published):
    manifest, folder = published
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], clock=clock, cap=2 * SHARD, daily_bytes=2 * SHARD)
        held = [cache.path_of(s.sha256, SHARD) for s in manifest.shards[:2]]
        assert cache.capped_until(clock.now) == (int(clock.now) // 86400 + 1) * 86400
        asked = len(mirror.requests)
        with pytest.raises(TransferCapReached):
            cache.path_of(manifest.shards[2].sha256, SHARD)
        assert len(mirror.requests) == asked  # not even a request that would stop at once
        assert all(os.path.exists(p) for p in held)  # nor room made for what cannot come
        assert cache.path_of(manifest.shards[0].sha256, SHARD) == held[0]  # held: still used
        clock.now = cache.capped_until(clock.now)
        assert cache.capped_until(clock.now) is None
        cache.path_of(manifest.shards[2].sha256, SHARD)


def test_a_full_disk_is_one_clear_error_and_leaves_no_partial(tmp_path, published, monkeypatch):
    manifest, folder = published
    sha = manifest.shards[0].sha256

    def disk_full(out, block):
        raise OSError(errno.ENOSPC, "No space left on device")

    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror])
        monkeypatch.setattr(BlobCache, "_write", staticmethod(disk_full))
        with pytest.raises(CacheError, match="disk full") as caught:
            cache.path_of(sha, SHARD)
        assert "\n" not in str(caught.value)
        assert not os.path.exists(tmp_path / "cache" / "partial" / sha)
        monkeypatch.undo()
        assert cache.path_of(sha, SHARD)  # the mirror was not blamed for our disk


def test_names_from_outside_never_become_paths(tmp_path):
    cache = BlobCache(str(tmp_path / "cache"), SHARD, [])
    for bad in ("../../etc/passwd", "A" * 64, "0" * 65, "/" + "0" * 63):
        with pytest.raises(Exception, match="not a blob name"):
            cache.path_of(bad)
    with pytest.raises(Exception, match="http"):
        HttpSource("file:///etc")


def test_pure_parts():
    limiter = RateLimiter(1000.0)
    assert limiter.delay(0.0, 500) == 0.0 and limiter.delay(0.0, 500) == pytest.approx(0.5)
    assert limiter.delay(5.0, 100) == 0.0  # idle time is not banked beyond now
    assert RateLimiter(None).delay(0.0, 10**9) == 0.0
    allowance = DailyAllowance(100)
    allowance.spend(0.0, 80)
    assert allowance.remaining(3600.0) == 20 and allowance.remaining(86400.0) == 100
    health = SourceHealth(retry_after_s=10)
    assert health.failed("m", 0.0) == 10 and not health.usable("m", 9.9) and health.usable("m", 10)
    assert health.failed("m", 10.0) == 20  # in a row: doubling
    health.succeeded("m")
    assert health.usable("m", 10.0)
    entries = [("a", 5, 3.0), ("b", 5, 1.0), ("c", 5, 2.0)]
    assert choose_evictions(entries, used=15, need=5, cap=15) == ["b"]
    assert choose_evictions(entries, used=15, need=10, cap=15, keep=frozenset({"c"})) == ["b", "a"]
    assert choose_evictions(entries, used=15, need=0, cap=15) == []


def test_worker_toml_cache_section(tmp_path):
    from idlegrad.common.errors import ConfigError
    from idlegrad.worker import config
    from idlegrad.worker.cache import GB, cache_from_settings

    text = (f"[cache]\ncache_dir = '{tmp_path / 'c'}'\ncache_max_gb = 0.5\ndownload_max_mbps = 8\n"
            "daily_transfer_max_gb = 2\nblob_mirrors = ['http://m1/data', 'https://m2']\n")
    settings = config.from_toml_text(text, "w.toml")
    assert config.from_toml_text(config.to_toml(settings), "printed") == settings
    cache = cache_from_settings(settings)
    assert cache.max_bytes == GB // 2 and cache.rate.bytes_per_s == 1e6
    assert cache.allowance.limit == 2 * GB
    assert [s.name for s in cache.sources] == ["http://m1/data", "https://m2"]
    off = config.from_toml_text("[cache]\ndownload_max_mbps = false", "w.toml")
    assert off.download_max_mbps is None and off.cache_max_gb == 10.0
    for bad, needle in (("cache_max_gb = 0", "cache.cache_max_gb: must be > 0"),
                        ("blob_mirrors = ['/srv/blobs']", "cache.blob_mirrors: '/srv/blobs' is not"),
                        ("daily_transfer_max_gb = -1", "cache.daily_transfer_max_gb")):
        with pytest.raises(ConfigError, match=needle):
            config.from_toml_text("[cache]\n" + bad, "w.toml")


def test_an_abandoned_partial_counts_and_goes_in_its_turn(tmp_path, published):
    manifest, folder = published
    a, b, c, d = (s.sha256 for s in manifest.shards)
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], cap=3 * SHARD, clock=clock)
        mirror.cut_after = 400
        with pytest.raises(CacheError):
            cache.path_of(a, SHARD)  # 400 bytes of a, left behind
        os.utime(tmp_path / "cache" / "partial" / a, (clock.now, clock.now))
        mirror.cut_after = None
        cache.health.succeeded(mirror.url)
        for name in (b, c):
            clock.now += 10
            cache.path_of(name, SHARD)
        assert cache.used_bytes() == 2 * SHARD + 400
        clock.now += 10
        cache.path_of(d, SHARD)  # the oldest, the partial, goes: and that is room enough
        assert not os.path.exists(tmp_path / "cache" / "partial" / a)
        assert [cache.has(n) for n in (b, c, d)] == [True, True, True]
        assert cache.used_bytes() == 3 * SHARD and cache.evicted == 1


def test_making_room_for_a_resume_keeps_its_partial(tmp_path, published):
    manifest, folder = published
    a, b = manifest.shards[0].sha256, manifest.shards[1].sha256
    clock = Clock()
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror], cap=SHARD + SHARD // 2, clock=clock)
        mirror.cut_after = 400
        with pytest.raises(CacheError):
            cache.path_of(a, SHARD)
        os.utime(tmp_path / "cache" / "partial" / a, (clock.now, clock.now))  # the oldest entry
        mirror.cut_after = None
        cache.health.succeeded(mirror.url)
        clock.now += 10
        cache.path_of(b, SHARD)
        clock.now += 10
        cache.path_of(a, SHARD)
        assert mirror.gets_of(a) == ["", "bytes=400-"] and not cache.has(b)


def test_one_download_per_blob_with_two_processes_sharing_the_cache(tmp_path, published):
    import subprocess
    import sys

    manifest, folder = published
    sha = manifest.shards[0].sha256
    script = ("import sys; from idlegrad.worker.cache import BlobCache, HttpSource; "
              "c = BlobCache(sys.argv[1], 10**6, [HttpSource(sys.argv[2])]); "
              "print(c.path_of(sys.argv[3], int(sys.argv[4])))")
    with Mirror(folder) as mirror:
        mirror.stall_s = 1.0  # the second process asks while the first downloads
        argv = [sys.executable, "-c", script, str(tmp_path / "cache"), mirror.url, sha, str(SHARD)]
        children = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [child.communicate(timeout=60)[0].strip() for child in children]
        assert all(child.returncode == 0 for child in children)
        assert outs[0] == outs[1] and len(mirror.gets_of(sha)) == 1
