"""The shared tier: full prompt pages of the streaming layers in LMCache's storage.

Below the host tier (`host_tier.py`: the RAM working set of one engine), the pages of full prompt
pages are written through LMCache's own storage — its ``StorageManager`` over its backends
(``LocalDiskBackend``, ``RemoteBackend`` with ``lm://`` = ``lmcache_server``, ``redis://``, ...),
its ``MemoryObj`` buffers and ``CacheEngineKey`` keys — so another engine, in another process or on
another host, that shares only the backend reuses a long prefix without recomputing it.

Tiering (docs/streaming.md, "The shared tier"): device window (a step's blocks) <- host tier pages
(the only RAM copy; LMCache's own CPU cache is off, ``local_cpu: False``, its buffer only stages
objects in flight) <- LMCache backend (persistent, shared). Only full prompt pages are written, once
each (pages a lookup found are not written back); pages the host tier evicts stay in the backend.

One object per (full prompt page, rank): the page's bytes of every streaming layer, as the host
store holds them, behind a small header (format version, the page's chained hash, the engine tag,
payload length, CRC-32) that every read checks: an object that is not exactly what this engine
would have written is a miss (with a warning), never K/V attended. The key is a ``CacheEngineKey``
whose model name is a digest of everything that decides the bytes (model, dtype, page size,
streaming layers, KV heads and head size, the host store's layout: token layout, or vLLM's CPU
kernel layout with its ISA, e.g. AMX packing), whose world size / worker id are the TP size / rank
and whose chunk hash is the page's chained hash (`host_tier.page_hashes`, seeded by the request key:
LoRA, cache salt, multimodal inputs).

Reads happen on the scheduler side, at lookup (`fetch`): the hit reported to vLLM is only the run of
pages already fetched and checked, so a backend that is down, goes away or holds damaged objects
costs a shorter hit (a recompute) and a warning, never a wrong token or a failed load. The fetched
bytes travel to the worker in the step's metadata, which copies them into the host store before
the forward. Writes happen on the worker after the step that completed the page (`put_pages`),
asynchronously where the backend is (LMCache's put tasks).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
import zlib
from collections import OrderedDict
from typing import Any

import torch

from .log import logger


FORMAT_VERSION = 1
_MAGIC = b"KVSSHP01"
_HEAD = struct.Struct("<8sI")  # magic, header length

# LMCache config keys the shared tier takes (kv_connector_extra_config["lmcache"]).
ALLOWED_KEYS = {
    "remote_url": "a remote backend: lm://HOST:PORT (lmcache_server), redis://HOST:PORT, ...",
    "remote_serde": "'naive' only (objects are bytes, not K/V tensors a codec understands)",
    "local_disk": "a folder for LMCache's LocalDiskBackend (file:// prefix optional)",
    "max_local_disk_size": "GB the local disk backend may hold",
    "max_local_cpu_size": "GB of LMCache's CPU buffer that stages objects in flight (default 0.5)",
    "blocking_timeout_secs": "seconds a blocking remote read may take (LMCache's default 10)",
    "local_cpu": "must be false: the host tier is the RAM copy",
    "extra_config": "LMCache's extra_config dict (e.g. use_exists_sync)",
}
DEFAULTS = {"local_cpu": False, "max_local_cpu_size": 0.5, "remote_serde": "naive"}
FETCH_BATCH = 64  # pages per batched get (bounds LMCache's staging buffer use)


def check_config(value: Any) -> dict[str, Any] | None:
    """Validate ``kv_connector_extra_config["lmcache"]`` (no LMCache import): a dict of the keys
    above naming at least one backend. Returns the LMCache config dict, defaults filled in."""
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise ValueError("kvstack streaming: 'lmcache' must be a dict of LMCache config keys "
                         f"(e.g. {{'remote_url': 'lm://127.0.0.1:65432'}}), not {value!r}")
    unknown = sorted(str(k) for k in value if k not in ALLOWED_KEYS)
    if unknown:
        raise ValueError(
            f"kvstack streaming: unknown or unsupported key(s) in 'lmcache': {', '.join(unknown)}; "
            "the shared tier takes " + "; ".join(f"{k} ({v})" for k, v in ALLOWED_KEYS.items()))
    cfg = dict(DEFAULTS, **value)
    if cfg["local_cpu"] not in (False, "false", "False", 0):
        raise ValueError("kvstack streaming: 'lmcache.local_cpu' must be false: the host tier is "
                         "the only RAM copy of the pages (LMCache's CPU buffer only stages objects)")
    cfg["local_cpu"] = False
    if cfg.get("remote_serde") not in ("naive", None):
        raise ValueError("kvstack streaming: 'lmcache.remote_serde' must be 'naive' (the shared "
                         f"tier's objects are bytes), not {cfg.get('remote_serde')!r}")
    url = cfg.get("remote_url")
    if url is not None and (not isinstance(url, str) or "://" not in url):
        raise ValueError("kvstack streaming: 'lmcache.remote_url' must be a URL such as "
                         f"lm://127.0.0.1:65432 or redis://127.0.0.1:6379, not {url!r}")
    disk = cfg.get("local_disk")
    try:
        disk_gb = float(cfg.get("max_local_disk_size", 0) or 0)
        cpu_gb = float(cfg["max_local_cpu_size"])
    except (TypeError, ValueError):
        raise ValueError("kvstack streaming: 'lmcache.max_local_disk_size' and "
                         "'max_local_cpu_size' must be numbers of GB") from None
    if disk and disk_gb <= 0:
        raise ValueError("kvstack streaming: 'lmcache.local_disk' needs max_local_disk_size > 0")
    if cpu_gb <= 0:
        raise ValueError("kvstack streaming: 'lmcache.max_local_cpu_size' must be positive (the "
                         "buffer that stages objects in flight)")
    if not url and not disk:
        raise ValueError("kvstack streaming: 'lmcache' names no backend: set remote_url "
                         "(lm://..., redis://...) and/or local_disk with max_local_disk_size")
    return cfg


def store_tag(in_place: bool, isa: str | None) -> str:
    """How the host store lays a page out: the token layout, or vLLM's CPU kernel layout whose
    packing depends on the kernel's ISA."""
    return f"cpu_kernel:{isa}" if in_place else "tokens"


def predict_store_tag(cfg, vllm_config, layout) -> str:
    """The host store's layout as the worker will choose it (worker_side.prepare), predicted from
    the configuration alone so the scheduler side keys its lookups the same way; the worker
    refuses to start when its choice differs (worker_side.prepare)."""
    if not cfg.cpu_native_attention:
        return store_tag(False, None)
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
    except Exception:  # noqa: BLE001
        return store_tag(False, None)
    if not current_platform.is_cpu():
        return store_tag(False, None)
    fits = False
    for size in CPUAttentionBackend.get_supported_kernel_block_sizes():
        base = getattr(size, "base", None)
        if (cfg.page_tokens % base == 0) if base else cfg.page_tokens == size:
            fits = True
    if not fits:
        return store_tag(False, None)
    isa = _get_attn_isa(vllm_config.model_config.dtype, layout.block_size, layout.head_size,
                        vllm_config.cache_config.cache_dtype)
    return store_tag(True, isa)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class SharedTier:
    """LMCache storage for the pages of one engine rank (see the module docstring)."""

    def __init__(self, lmc: dict[str, Any], *, model_id: str, layers: tuple[str, ...],
                 page_tokens: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 tag: str, rank: int = 0, world_size: int = 1):
        self.lmc = dict(lmc)
        self.layers = tuple(layers)
        self.page_tokens = page_tokens
        self.dtype = dtype
        self.tag = tag
        self.rank, self.world_size = rank, world_size
        self.page_bytes = 2 * page_tokens * num_kv_heads * head_size * dtype.itemsize
        self.payload_bytes = self.page_bytes * len(self.layers)
        ident = json.dumps(dict(v=FORMAT_VERSION, model=model_id, layers=list(self.layers),
                                page_tokens=page_tokens, heads=num_kv_heads, head_size=head_size,
                                dtype=_dtype_name(dtype), tag=tag, world_size=world_size),
                           sort_keys=True)
        self.ident = hashlib.sha256(ident.encode()).hexdigest()[:24]
        self.model_name = f"kvstack-stream-{self.ident}"
        self._kv_shape = (len(self.layers), 2, page_tokens, num_kv_heads, head_size)
        self._sm = None
        self._lock = threading.Lock()
        self._closed = False
        self._warned: dict[str, float] = {}
        # keys put and not yet seen in the backend (LMCache's batched remote puts are not
        # tracked in its put_tasks): what `flush` waits for at exit
        self._unconfirmed: "OrderedDict[Any, None]" = OrderedDict()
        self.stats = dict(shared_hit_pages=0, shared_hit_requests=0, shared_saved_pages=0,
                          shared_rejected_objects=0, shared_errors=0, shared_fetch_ms=0.0)

    # ---- LMCache's storage ----------------------------------------------------------------
    def open(self) -> "SharedTier":
        """Build LMCache's StorageManager (its backends) from the config dict, as LMCache's own
        engine does; an unusable configuration is refused here, at start-up."""
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        config = LMCacheEngineConfig.from_dict(dict(self.lmc, chunk_size=self.page_tokens))
        validate = getattr(config, "validate", None)
        if callable(validate):
            validate()
        metadata = LMCacheMetadata(
            model_name=self.model_name, world_size=self.world_size,
            local_world_size=self.world_size, worker_id=self.rank, local_worker_id=self.rank,
            kv_dtype=self.dtype, kv_shape=self._kv_shape, chunk_size=self.page_tokens)
        self._sm = StorageManager(config, metadata, event_manager=EventManager())
        names = [n for n in self._sm.storage_backends if n != "LocalCPUBackend"]
        if not names:
            self._sm.close()
            raise ValueError(f"kvstack streaming: LMCache built no storage backend from "
                             f"'lmcache' = {self.lmc!r}")
        # LMCache's storage thread is not a daemon: flush and close before the interpreter joins
        # it at exit (else engine A would never exit, or exit with its puts unsent)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self.close)
        else:  # pragma: no cover
            import atexit

            atexit.register(self.close)
        logger.info("kvstack streaming: shared tier on LMCache backends %s (objects %s, "
                    "%d bytes a page)", ", ".join(names), self.model_name, self.payload_bytes)
        return self

    def key(self, page_hash: bytes):
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(model_name=self.model_name, world_size=self.world_size,
                              worker_id=self.rank,
                              chunk_hash=int.from_bytes(page_hash[:16], "big"), dtype=self.dtype)

    def _warn(self, what: str, msg: str, *args) -> None:
        """A warning per kind of trouble, at most every 10 s (a dead backend is asked often)."""
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 10.0:
            self._warned[what] = now
            logger.warning("kvstack streaming: shared tier: " + msg, *args)

    # ---- objects ---------------------------------------------------------------------------
    def _header(self, page_hash: bytes, crc: int) -> bytes:
        head = json.dumps(dict(v=FORMAT_VERSION, id=self.ident, page=page_hash.hex(),
                               n=self.payload_bytes, crc=crc), sort_keys=True).encode()
        return _HEAD.pack(_MAGIC, len(head)) + head

    def _check(self, page_hash: bytes, blob: torch.Tensor) -> torch.Tensor | None:
        """The payload of an object read back, or None (with a warning) if it is not exactly
        what this engine writes for this page."""
        raw = blob.reshape(-1)
        try:
            magic, hlen = _HEAD.unpack(bytes(raw[:_HEAD.size].tolist()))
            if magic != _MAGIC:
                raise ValueError("bad magic")
            head = json.loads(bytes(raw[_HEAD.size:_HEAD.size + hlen].tolist()))
            start = _HEAD.size + hlen
            payload = raw[start:start + self.payload_bytes]
            if (head.get("v") != FORMAT_VERSION or head.get("id") != self.ident
                    or head.get("page") != page_hash.hex() or head.get("n") != self.payload_bytes
                    or payload.numel() != self.payload_bytes):
                raise ValueError("header does not match this engine's page")
            if zlib.crc32(payload.numpy()) != head.get("crc"):
                raise ValueError("checksum mismatch")
        except Exception as e:  # noqa: BLE001
            self.stats["shared_rejected_objects"] += 1
            self._warn("reject", "object for page %s rejected (%s): treated as a miss, the page "
                       "is recomputed", page_hash.hex()[:16], e)
            return None
        return payload

    # ---- read (scheduler side) -------------------------------------------------------------
    def fetch(self, hashes: list[bytes], first: int, limit: int) -> list[torch.Tensor]:
        """Pages ``first``, ``first + 1``, ... (< ``limit``) of a prompt's hash chain as the
        backend holds them, fetched and checked: the payloads (uint8, own memory) of the
        leading run that is complete; empty on a miss or any error (with a warning)."""
        if self._sm is None or first >= limit:
            return []
        out: list[torch.Tensor] = []
        found = 0
        t0 = time.perf_counter()
        try:
            keys = [self.key(h) for h in hashes[first:limit]]
            found, where = self._sm.batched_contains(keys)
            # read each run from the backend that listed it (LMCache's batched_get would stop at
            # its CPU backend, which holds nothing here)
            runs = [(name, len(ks)) for name, ks in where.items()]
            b = 0
            for name, n in runs:
                for c in range(b, b + n, FETCH_BATCH):
                    part = keys[c:min(b + n, c + FETCH_BATCH)]
                    objs = self._sm.batched_get(part, location=name)
                    try:
                        for i, obj in enumerate(objs):
                            if obj is None or obj.tensor is None:
                                raise _Short()
                            payload = self._check(hashes[first + c + i], obj.tensor)
                            if payload is None:
                                raise _Short()
                            out.append(payload.clone())
                    finally:
                        for obj in objs:
                            if obj is not None:
                                obj.ref_count_down()
                b += n
        except _Short:
            self._warn("short", "the backend listed %d page(s), %d could be read and checked: "
                       "the rest is recomputed", found, len(out))
        except Exception as e:  # noqa: BLE001
            self.stats["shared_errors"] += 1
            self._warn("fetch", "lookup/fetch failed (%s: %s): %d page(s) read before it are "
                       "used, the rest is recomputed", type(e).__name__, e, len(out))
        self.stats["shared_fetch_ms"] += (time.perf_counter() - t0) * 1e3
        if out:
            self.stats["shared_hit_pages"] += len(out)
            self.stats["shared_hit_requests"] += 1
        return out

    # ---- write (worker side) ---------------------------------------------------------------
    def put_pages(self, items: list[tuple[bytes, list[torch.Tensor]]]) -> None:
        """Store pages: (page hash, the page's byte tensors of every streaming layer, in layer
        order). Asynchronous where LMCache's backend is; failures are warnings."""
        if self._sm is None or not items:
            return
        from lmcache.v1.memory_management import MemoryFormat

        keys, objs = [], []
        try:
            for page_hash, parts in items:
                parts = [p.reshape(-1) for p in parts]
                if sum(p.numel() for p in parts) != self.payload_bytes:
                    raise ValueError("page of unexpected size")
                crc = 0
                for p in parts:
                    crc = zlib.crc32(p.numpy(), crc)
                head = self._header(page_hash, crc)
                obj = self._sm.allocate(torch.Size([1, len(head) + self.payload_bytes]),
                                        torch.uint8, fmt=MemoryFormat.EC_TD, eviction=False,
                                        busy_loop=False)
                if obj is None or obj.tensor is None:
                    self._warn("alloc", "LMCache's staging buffer is full (max_local_cpu_size): "
                               "%d page(s) not stored", len(items) - len(objs))
                    if obj is not None:
                        obj.ref_count_down()
                    break
                flat = obj.tensor.view(-1)
                flat[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
                off = len(head)
                for p in parts:
                    flat[off:off + p.numel()].copy_(p)
                    off += p.numel()
                keys.append(self.key(page_hash))
                objs.append(obj)
            if objs:
                self._sm.batched_put(keys, objs)  # takes the objects' references
                self.stats["shared_saved_pages"] += len(objs)
                for k in keys:
                    self._unconfirmed[k] = None
                while len(self._unconfirmed) > 4096:
                    self._unconfirmed.popitem(last=False)
        except Exception as e:  # noqa: BLE001
            self.stats["shared_errors"] += 1
            self._warn("put", "store failed (%s: %s): the pages stay in this engine's host tier "
                       "only", type(e).__name__, e)

    # ---- shutdown --------------------------------------------------------------------------
    def flush(self, timeout: float = 15.0) -> bool:
        """Wait (up to `timeout` s) until the backend holds every page put (the last 4096);
        False (with a warning) if some never arrived."""
        if self._sm is None:
            return True
        end = time.monotonic() + timeout
        while self._unconfirmed and time.monotonic() < end:
            for k in list(self._unconfirmed):
                if self._sm.contains(k) is None:
                    break
                del self._unconfirmed[k]
            else:
                break
            time.sleep(0.02)
        if self._unconfirmed:
            logger.warning("kvstack streaming: shared tier: %d page(s) put were not seen in the "
                           "backend after %.0f s", len(self._unconfirmed), timeout)
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed or self._sm is None:
                return
            self._closed = True
        try:
            self.flush()
            # Stop LMCache's storage thread, but without StorageManager.close(): its backends'
            # close() can deadlock on that thread (LMCache 0.5.6's RedisConnector.close waits, on
            # the event loop, for a future that needs the event loop), which would keep the
            # process from ever exiting. Connections close with the process.
            sm = self._sm
            if sm.loop.is_running():
                sm.loop.call_soon_threadsafe(sm.loop.stop)
            sm.thread.join(timeout=10.0)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstack streaming: closing the shared tier: %s", e)


class _Short(Exception):
    pass


_OPEN: dict[tuple, SharedTier] = {}
_OPEN_LOCK = threading.Lock()


def open_shared_tier(lmc: dict[str, Any], **kw: Any) -> SharedTier:
    """One `SharedTier` per process, configuration and rank: the scheduler side and the worker
    side of an engine whose worker runs in the scheduler's process share one StorageManager (one
    connection, one staging buffer)."""
    ident = (json.dumps(lmc, sort_keys=True, default=str),
             json.dumps({k: (str(v) if not isinstance(v, (int, str, tuple)) else v)
                         for k, v in kw.items()}, sort_keys=True, default=str))
    with _OPEN_LOCK:
        tier = _OPEN.get(ident)
        if tier is None or tier._closed:
            tier = _OPEN[ident] = SharedTier(lmc, **kw).open()
        return tier


def refusal(cfg, layout, vllm_config) -> str | None:
    """Why the shared tier cannot serve this engine, or None."""
    if not cfg.prefix_reuse:
        return ("the shared tier ('lmcache') reuses prefixes: it needs prefix_reuse on "
                "(drop 'lmcache' or 'prefix_reuse: false')")
    if not layout.reuse_ok:
        return ("the shared tier ('lmcache') restores only the host tier's pages, but this "
                "model's layers outside the host tier would need their device KV restored at a "
                "hit (full-attention layers left out of 'streaming_layers', sliding-window or "
                "Mamba layers): stream them too, or drop 'lmcache'")
    par = vllm_config.parallel_config
    tp = getattr(par, "tensor_parallel_size", 1) or 1
    pp = getattr(par, "pipeline_parallel_size", 1) or 1
    if tp > 1 or pp > 1:
        return (f"the shared tier ('lmcache') is not supported with tensor or pipeline "
                f"parallelism (tensor_parallel_size={tp}, pipeline_parallel_size={pp}): the "
                "scheduler side fetches the pages, and each rank holds other KV heads or layers; "
                "run one rank or drop 'lmcache'")
    return None


def open_for_engine(cfg, layout, vllm_config, tag: str) -> SharedTier:
    """The engine's shared tier, refused with a clear error when it cannot serve it."""
    why = refusal(cfg, layout, vllm_config)
    if why:
        raise ValueError("kvstack StreamingConnector: " + why)
    mc = vllm_config.model_config
    model_id = f"{mc.model}@{getattr(mc, 'revision', None) or ''}"
    return open_shared_tier(cfg.lmcache_config, model_id=model_id, layers=tuple(layout.layers),
                            page_tokens=cfg.page_tokens, num_kv_heads=layout.num_kv_heads,
                            head_size=layout.head_size, dtype=layout.dtype, tag=tag, rank=0,
                            world_size=1)
