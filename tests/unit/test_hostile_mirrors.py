"""Hostile mirrors against the worker's blob cache (worker/cache.py, worker/fetch.py), over a real
HTTP mirror on loopback (blob_mirror.py): a partial left longer than the blob or with bad bytes,
a false Content-Length, a mirror dripping its bytes. Each leaves the blob fetchable from the next
source, and the worker running."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from idlegrad.worker.cache import BlobCache, HttpSource
from idlegrad.worker.fetch import DownloadPace

from .blob_mirror import Mirror
from .test_cache import SHARD, cache_for, publish_four_shards


@pytest.fixture
def published(tmp_path):
    return publish_four_shards(tmp_path)


def hash_of(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def test_a_manifest_partial_longer_than_the_blob_is_discarded_and_fetched_again(tmp_path,
                                                                               published):
    manifest, folder = published
    sha = manifest.sha256
    real = len(manifest.to_bytes())
    with Mirror(folder) as hostile, Mirror(folder) as honest:
        hostile.pad, hostile.cut_after = 2 * real, 2 * real  # junk after the body, then cut
        cache = cache_for(tmp_path, [hostile, honest])
        path = cache.path_of(sha)  # a manifest is asked for by name alone: no size
        assert hash_of(path) == sha
        # the honest mirror refused the resume (416); the partial went, not the mirror
        assert honest.gets_of(sha) == [f"bytes={2 * real}-", ""]
        assert cache.health.usable(honest.url, cache.clock())
        assert not os.path.exists(tmp_path / "cache" / "partial" / sha)


def test_a_partial_with_a_hostile_mirrors_bytes_costs_the_honest_mirror_nothing(tmp_path,
                                                                               published):
    manifest, folder = published
    sha = manifest.shards[1].sha256
    with Mirror(folder) as hostile, Mirror(folder) as honest:
        hostile.lie, hostile.cut_after = True, 400  # 400 bytes kept, the first one wrong
        cache = cache_for(tmp_path, [hostile, honest])
        path = cache.path_of(sha, SHARD)
        assert hash_of(path) == sha
        assert honest.gets_of(sha) == ["bytes=400-", ""]  # resumed, failed the hash, from 0
        assert cache.health.usable(honest.url, cache.clock())
        assert cache.path_of(manifest.shards[2].sha256, SHARD)  # and it still serves


def test_a_content_length_of_a_petabyte_skips_the_mirror_before_its_body(tmp_path, published):
    manifest, folder = published
    with Mirror(folder) as hostile, Mirror(folder) as honest:
        hostile.content_length = 10**15
        cache = cache_for(tmp_path, [hostile, honest])
        path = cache.path_of(manifest.sha256)  # not CacheTooSmall: that stops the worker
        assert hash_of(path) == manifest.sha256
        assert not cache.health.usable(hostile.url, cache.clock())
        assert len(honest.requests) == 1
        shard = manifest.shards[0]
        hostile_asked = len(hostile.requests)
        cache.health.succeeded(hostile.url)
        assert hash_of(cache.path_of(shard.sha256, SHARD)) == shard.sha256  # a shard, too
        assert len(hostile.requests) == hostile_asked + 1
        assert not os.path.exists(tmp_path / "cache" / "partial" / shard.sha256)


def test_a_range_answer_whose_length_disagrees_with_its_range_is_refused(published):
    manifest, folder = published
    sha = manifest.shards[2].sha256
    with Mirror(folder) as mirror:
        mirror.content_length = 10**15
        with pytest.raises(Exception, match=r"Content-Length 1000000000000000 for bytes 300"):
            HttpSource(mirror.url).open(sha, 300)


def test_a_mirror_dripping_its_bytes_is_left_for_the_next_source(tmp_path, published):
    manifest, folder = published
    sha = manifest.shards[0].sha256
    with Mirror(folder) as slow, Mirror(folder) as fast:
        slow.drip_s = 0.05  # 20 B/s: the shard would take 50 s
        cache = BlobCache(str(tmp_path / "cache"), 10 * SHARD,
                          [HttpSource(slow.url, 5.0), HttpSource(fast.url, 5.0)],
                          min_bytes_per_s=1000.0, pace_grace_s=0.5)
        got: list = []
        fetcher = threading.Thread(target=lambda: got.append(cache.path_of(sha, SHARD)),
                                   daemon=True)
        began = time.monotonic()
        fetcher.start()
        fetcher.join(15.0)
        assert got, "the download was still held by the dripping mirror after 15 s"
        assert time.monotonic() - began < 10.0
        assert hash_of(got[0]) == sha
        assert not cache.health.usable(slow.url, time.time())
        dripped = int(fast.gets_of(sha)[0].removeprefix("bytes=").rstrip("-") or 0)
        assert 0 < dripped < SHARD  # what came before it was given up was kept, and resumed


def test_a_download_keeps_pace_within_its_grace_and_its_deadline():
    pace = DownloadPace(started=100.0, expected=10_000, min_bytes_per_s=100.0, grace_s=30.0)
    assert pace.deadline == 100.0 + 30.0 + 100.0
    assert pace.too_slow(129.0, 0) is None  # in the grace, any pace
    assert "below the minimum of 100 B/s" in pace.too_slow(140.0, 1000)
    assert pace.too_slow(140.0, 4000) is None  # 100 B/s on average
    assert "past the deadline of 130 s" in pace.too_slow(231.0, 9999)
