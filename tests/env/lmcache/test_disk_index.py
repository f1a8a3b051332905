"""Unit level: LMCache's LocalDiskBackend indexes the chunk files an earlier process left
(LMCache patch 0007 on base 0.32, 0006 on 0.25). No engine: backends are built directly on a temporary folder, and a
"new process" is a new backend object on the same folder (the index is rebuilt from the files only).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path
from unittest.mock import MagicMock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import local_disk_backend as ldb  # noqa: E402

if not hasattr(ldb, "_SIDECAR_SUFFIX"):
    pytest.fail("LMCache patch 0007/0006 (disk index) is not applied to the installed LMCache")

CHUNK = 32
LAYERS, HEADS, HEAD = 2, 2, 8
SHAPE = (2, LAYERS, CHUNK, HEADS * HEAD)  # KV_2LTD: [2, layers, tokens, hidden]


def meta(**over) -> LMCacheMetadata:
    kw = dict(model_name="tiny/model", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
              kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD), chunk_size=CHUNK)
    kw.update(over)
    return LMCacheMetadata(**kw)


def mem_obj(shape, fill: float, dtype=torch.bfloat16) -> TensorMemoryObj:
    raw = torch.full(shape, fill, dtype=dtype).flatten().view(torch.uint8)
    md = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=raw.numel(), ref_count=1,
                           fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw, md, None)


class _Tap(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def tap():
    h = _Tap()
    log = logging.getLogger(ldb.__name__)
    log.addHandler(h)
    yield h
    log.removeHandler(h)


@pytest.fixture
def make_backend(tmp_path):
    """Backends on a folder; each gets its own running event loop (its disk worker needs one)."""
    loops, made = [], []

    def make(folder: Path | None = None, metadata: LMCacheMetadata | None = None, max_gb: float = 1.0):
        folder = folder or tmp_path / "disk"
        config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_disk=f"file://{folder}/",
                                                   max_local_disk_size=max_gb, local_cpu=False)
        cpu = MagicMock()
        cpu.allocate.side_effect = lambda shape, dtype, fmt, **_: mem_obj(shape, 0.0, dtype)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        loops.append((loop, thread))
        b = ldb.LocalDiskBackend(config, loop, cpu, "cpu", None, metadata or meta())
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()
    for loop, thread in loops:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def key(i: int, **over) -> CacheEngineKey:
    kw = dict(model_name="tiny/model", world_size=1, worker_id=0, chunk_hash=0x1000 + i, dtype=torch.bfloat16)
    kw.update(over)
    return CacheEngineKey(**kw)


def write(backend, k, shape=SHAPE, fill=1.0):
    """What a put does, synchronously: account the size, then the worker's save."""
    obj = mem_obj(shape, fill)
    backend.current_cache_size += obj.get_physical_size()
    backend.disk_worker.insert_put_task(k)
    backend.async_save_bytes_to_disk(k, obj)
    return obj


def sidecar(backend, k) -> Path:
    return Path(backend._key_to_path(k) + ldb._SIDECAR_SUFFIX)


def test_new_backend_indexes_complete_chunks_and_loads_the_same_bytes(make_backend, tap):
    a = make_backend()
    write(a, key(0), fill=0.5)
    write(a, key(1), shape=(2, LAYERS, 4, HEADS * HEAD), fill=-2.0)  # a partial (4-token) last chunk
    rec = json.loads(sidecar(a, key(0)).read_text())
    assert rec["key"] == key(0).to_string() and rec["shape"] == list(SHAPE)
    assert rec["dtype"] == "bfloat16" and rec["fmt"] == "KV_2LTD"

    b = make_backend()  # "a new process": only the files are shared
    assert set(b.dict) == {key(0), key(1)}
    assert b.contains(key(0)) and b.contains(key(1))
    assert b.current_cache_size == a.current_cache_size
    got = b.get_blocking(key(1))
    assert got is not None and tuple(got.metadata.shape) == (2, LAYERS, 4, HEADS * HEAD)
    assert torch.equal(got.tensor, torch.full((2, LAYERS, 4, HEADS * HEAD), -2.0, dtype=torch.bfloat16))
    assert any("Indexed 2 chunk(s)" in ln for ln in tap.lines), tap.lines


def test_bad_or_foreign_files_are_skipped_with_a_warning_and_kept(make_backend, tap):
    a = make_backend()
    for i in range(7):
        write(a, key(i))
    # 0: good.  1: data file truncated.  2: sidecar not JSON.  3: sidecar names another key.
    # 4: shape the engine would not use.  5: data file without sidecar.  6: sidecar without data file.
    p1 = Path(a._key_to_path(key(1)))
    p1.write_bytes(p1.read_bytes()[:-2])
    sidecar(a, key(2)).write_text('{"format": "kvstack-lmcache-disk-chunk/1", "key": ')
    rec3 = json.loads(sidecar(a, key(3)).read_text())
    rec3["key"] = key(0).to_string()
    sidecar(a, key(3)).write_text(json.dumps(rec3))
    rec4 = json.loads(sidecar(a, key(4)).read_text())
    rec4["shape"] = [2, LAYERS, CHUNK // 2, HEADS * HEAD * 2]  # same byte count, wrong layout
    sidecar(a, key(4)).write_text(json.dumps(rec4))
    sidecar(a, key(5)).unlink()
    Path(a._key_to_path(key(6))).unlink()
    before = sorted(p.name for p in Path(a.path).iterdir())

    tap.lines.clear()
    b = make_backend()
    assert set(b.dict) == {key(0)}
    assert b.current_cache_size == a.dict[key(0)].size
    for i in range(1, 7):
        assert not b.contains(key(i)) and b.get_blocking(key(i)) is None
    skipped = [ln for ln in tap.lines if ln.startswith("Skipping")]
    assert len(skipped) == 6, tap.lines
    for i, why in [(1, "data file holds"), (2, "does not parse"), (3, "does not name this file"),
                   (4, "does not fit"), (5, "no metadata sidecar"), (6, "data file is missing")]:
        name = Path(a._key_to_path(key(i))).name
        assert any(name in ln and why in ln for ln in skipped), (i, why, skipped)
    assert sorted(p.name for p in Path(a.path).iterdir()) == before  # nothing deleted


def test_chunks_of_another_engine_config_are_not_indexed(make_backend, tap):
    a = make_backend()
    write(a, key(0))
    for other in (meta(worker_id=1), meta(model_name="other/model"), meta(kv_dtype=torch.float16),
                  meta(world_size=2), meta(kv_shape=(LAYERS + 1, 2, CHUNK, HEADS, HEAD)),
                  meta(chunk_size=CHUNK // 2, kv_shape=(LAYERS, 2, CHUNK // 2, HEADS, HEAD))):
        tap.lines.clear()
        b = make_backend(metadata=other)
        assert not b.dict and b.current_cache_size == 0
        assert any(ln.startswith("Skipping") for ln in tap.lines), (other, tap.lines)
    assert Path(a._key_to_path(key(0))).is_file() and sidecar(a, key(0)).is_file()


def test_index_respects_max_local_disk_size_newest_first(make_backend, tmp_path):
    a = make_backend()
    for i in range(3):
        write(a, key(i))
        path = a._key_to_path(key(i))
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # key 2 is the newest
    size = a.dict[key(0)].size
    b = make_backend(max_gb=(2 * size + size // 2) / 1024**3)  # room for two chunks
    assert list(b.dict) == [key(1), key(2)]  # oldest first in the LRU order
    assert b.current_cache_size == 2 * size


def test_eviction_and_rewrite_remove_the_sidecar(make_backend):
    a = make_backend()
    write(a, key(0))
    data, side = Path(a._key_to_path(key(0))), sidecar(a, key(0))
    b = make_backend()
    assert b.remove(key(0))
    assert not data.exists() and not side.exists()
    write(b, key(0))
    assert side.exists()
    # A rewrite drops the old sidecar before the data file is written, and writes a new one after.
    seen = []
    orig = b.write_file
    b.write_file = lambda buf, path: (seen.append(side.exists()), orig(buf, path))
    write(b, key(0), fill=3.0)
    assert seen == [False] and side.exists()
