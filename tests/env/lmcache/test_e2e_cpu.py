"""End to end on the CPU engine: in-process LMCacheConnectorV1 with the kvstack patches.

Each engine runs in its own process (engine_run.py), as a user would start one. Tokens of every
LMCache run are compared with a run without any KV connector.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))

CHUNK = 32
PROMPT_A = [(i * 37) % 900 + 3 for i in range(100)]  # 100 tokens: 3 full chunks of 32
PROMPT_EXT = PROMPT_A + [5, 6, 7, 8] * 10  # extends A by 40 tokens


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    from kvstack.testbed.tiny_models import make_model

    root = tmp_path_factory.mktemp("tiny-models")
    return lambda name: make_model(name, root / name)


def run_engine(model_dir, name, prompts, tmp_path, *, lmcache=False, wipe=False, env=None,
               extra_args=()):
    tmp_path.mkdir(parents=True, exist_ok=True)
    pfile = tmp_path / f"prompts-{time.monotonic_ns()}.json"
    pfile.write_text(json.dumps(prompts))
    cmd = [sys.executable, str(HERE / "engine_run.py"), "--model", name, "--model-dir", str(model_dir),
           "--prompts", str(pfile), "--max-num-batched-tokens", "64"]
    if lmcache:
        cmd.append("--lmcache")
    if wipe:
        cmd.append("--wipe")
    cmd += list(extra_args)
    full_env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                "LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_DISABLE_BANNER": "1", **(env or {})}
    full_env.pop("LMCACHE_HYBRID_STATE_DIR", None)
    for key in [k for k, v in full_env.items() if v is None]:  # env={"X": None}: X unset
        del full_env[key]
    res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        raise AssertionError(f"engine run failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}")
    return json.loads(lines[-1])


LOCAL_CPU = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5"}
# The Qwen3-Next runs step one chunk at a time: every step ends on a chunk boundary (a state at
# 32, 64, 96) and a restored prefix continues with the very steps the baseline ran, so greedy
# tokens compare bit for bit. The long-memory model has many near-ties at bf16 (top-2 margins of
# 0.06 nats and less): a prefill restored at 96 and continued 96 -> 128 -> 140 flipped one against
# a baseline that ran 0 -> 64 -> 128 -> 140, with logprobs within 0.04 nats of it. With 64-token
# steps the scheduler cuts a step at its last chunk boundary instead (vLLM 0010 / LMCache 0018:
# tests/env/lmcache/test_hybrid_checkpoint_steps.py and the server tests run that).
QWEN_STEPS = ("--max-num-batched-tokens", str(CHUNK))


@pytest.fixture(scope="module")
def qwen_model(tiny, tmp_path_factory):
    """The tiny Qwen3-Next with a long-memory GDN state (hybrid_models.py): restoring a wrong or
    zeroed state changes its tokens, so comparing tokens checks the state restore too."""
    sys.path.insert(0, str(HERE))
    from hybrid_models import long_memory_qwen3next

    return long_memory_qwen3next(tiny("qwen3next"), tmp_path_factory.mktemp("qwen-long") / "model")


@pytest.fixture(scope="module")
def qwen_baseline(qwen_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen-baseline")
    out = run_engine(qwen_model, "qwen3next", [PROMPT_A, PROMPT_EXT], tmp, extra_args=QWEN_STEPS)
    return {"A": out["tokens"][0], "EXT": out["tokens"][1]}


def test_llama_in_process_hit_and_same_tokens(tiny, tmp_path):
    """Non-hybrid model: the second run loads from LMCache (engine KV wiped) and decodes the same."""
    base = run_engine(tiny("llama"), "llama", [PROMPT_A], tmp_path)
    out = run_engine(tiny("llama"), "llama", [PROMPT_A, PROMPT_A], tmp_path, lmcache=True, wipe=True,
                     env=LOCAL_CPU)
    assert out["hits"][0] == 0
    assert out["hits"][1] == 96  # 3 whole chunks; the 4 trailing tokens are recomputed
    assert out["restored"] == [0, 0]  # no hybrid state for a single-group model
    assert out["tokens"] == [base["tokens"][0]] * 2


def test_qwen3next_local_cpu_restores_hybrid_state(qwen_model, tmp_path, qwen_baseline):
    out = run_engine(qwen_model, "qwen3next", [PROMPT_A, PROMPT_A, PROMPT_EXT], tmp_path,
                     lmcache=True, wipe=True, env=LOCAL_CPU, extra_args=QWEN_STEPS)
    # State is saved where a scheduler step ends on a chunk boundary (32, 64, 96 with 32-token
    # steps), so the 96 cached tokens are used, K/V and state.
    assert out["hits"] == [0, 96, 96]
    assert out["restored"] == [0, 96, 96]
    assert out["tokens"] == [qwen_baseline["A"], qwen_baseline["A"], qwen_baseline["EXT"]]


DISK_ONLY = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}


def _disk_env(folder: Path) -> dict:
    return {**DISK_ONLY, "LMCACHE_LOCAL_DISK": f"file://{folder}/"}


@pytest.fixture(scope="module")
def qwen_disk_written(qwen_model, tmp_path_factory, qwen_baseline):
    """A local-disk folder written by one engine process (no CPU tier): K/V chunk files, the
    hybrid states (LMCache objects too, format EC_TD) and a sidecar for each. Tests copy it
    before using it."""
    tmp = tmp_path_factory.mktemp("qwen-disk")
    out = run_engine(qwen_model, "qwen3next", [PROMPT_A], tmp, lmcache=True, env=_disk_env(tmp / "disk"),
                     extra_args=QWEN_STEPS)
    assert out["hits"] == [0] and out["tokens"] == [qwen_baseline["A"]]
    assert out["indexed"] is None  # an empty folder: nothing to index
    disk = tmp / "disk"
    chunks = sorted(disk.glob("*.pt"))
    assert sorted(p.name + ".kvmeta" for p in chunks) == sorted(p.name for p in disk.glob("*.pt.kvmeta"))
    assert len(_files(disk, "KV_2LTD")) >= 3  # 100 tokens: 3 whole 32-token chunks (+ the partial one)
    assert len(_files(disk, "EC_TD")) == 3  # the states at 32, 64 and 96 (one step per chunk)
    assert not (disk / "hybrid-state").exists()  # no state directory beside LMCache's storage
    return disk


def _files(disk: Path, fmt: str) -> list[Path]:
    """The data files in `disk` whose sidecar names this MemoryFormat."""
    return sorted(p for p in disk.glob("*.pt")
                  if json.loads(p.with_name(p.name + ".kvmeta").read_text())["fmt"] == fmt)


def test_qwen3next_local_disk_new_engine_process(qwen_model, tmp_path, qwen_baseline, qwen_disk_written):
    """Local disk backend only (no CPU tier): a NEW engine process indexes the chunk files the
    first one wrote, hits from disk, restores the hybrid state kept next to them and decodes the
    same tokens (engine KV wiped before each prompt, so every hit is a load from disk)."""
    disk = tmp_path / "disk"
    shutil.copytree(qwen_disk_written, disk)
    n_chunks = len(list(disk.glob("*.pt")))
    out = run_engine(qwen_model, "qwen3next", [PROMPT_A, PROMPT_EXT], tmp_path, lmcache=True,
                     wipe=True, env=_disk_env(disk), extra_args=QWEN_STEPS)
    assert out["indexed"] == n_chunks
    assert not [w for w in out["warnings"] if "Skipping disk cache file" in w], out["warnings"]
    # 96 tokens are on disk, and the hybrid state at 96, so both hit 96.
    assert out["hits"] == [96, 96] and out["restored"] == [96, 96]
    assert out["tokens"] == [qwen_baseline["A"], qwen_baseline["EXT"]]


def test_qwen3next_local_disk_bad_files_are_a_miss(qwen_model, tmp_path, qwen_baseline, qwen_disk_written):
    """K/V chunk files a new engine must not trust: truncated data files, a sidecar that does not
    parse, a sidecar whose dtype is not the engine's. Each is skipped with a warning and left
    on disk; the state alone is indexed but without its K/V the request is a miss, recomputed
    with the same tokens."""
    disk = tmp_path / "disk"
    shutil.copytree(qwen_disk_written, disk)
    chunks = _files(disk, "KV_2LTD")
    for i, path in enumerate(chunks):
        side = path.with_name(path.name + ".kvmeta")
        if i % 3 == 0:
            path.write_bytes(path.read_bytes()[:-64])  # truncated data file
        elif i % 3 == 1:
            side.write_text(side.read_text()[:-5])  # sidecar cut short: no longer JSON
        else:
            rec = json.loads(side.read_text())
            rec["dtype"] = "half"  # a sidecar that does not match this engine
            side.write_text(json.dumps(rec))
    before = {p.name for p in disk.iterdir()}
    out = run_engine(qwen_model, "qwen3next", [PROMPT_A], tmp_path, lmcache=True, wipe=True,
                     env=_disk_env(disk), extra_args=QWEN_STEPS)
    assert out["indexed"] == len(_files(disk, "EC_TD"))
    skipped = [w for w in out["warnings"] if "Skipping disk cache file" in w]
    assert len(skipped) == len(chunks), out["warnings"]
    assert any("data file holds" in w for w in skipped) and any("does not parse" in w for w in skipped)
    if len(chunks) >= 3:
        assert any("is not this engine's" in w for w in skipped)
    assert out["hits"] == [0] and out["restored"] == [0]
    assert out["tokens"] == [qwen_baseline["A"]]
    # Nothing was deleted (the recomputed prompt is stored again, over the files it skipped).
    assert before <= {p.name for p in disk.iterdir()}


def test_qwen3next_tampered_state_is_a_miss(qwen_model, tmp_path, qwen_baseline, qwen_disk_written):
    """A state object whose header no longer names this model (so its checksum fails too): the
    K/V chunks are indexed and found, the state is read and rejected with a warning, the load
    fails and vLLM recomputes: same tokens, nothing restored."""
    disk = tmp_path / "disk"
    shutil.copytree(qwen_disk_written, disk)
    for path in _files(disk, "EC_TD"):
        data = bytearray(path.read_bytes())
        i = data.index(b'"model": "') + len(b'"model": "')
        data[i] ^= 0x01
        path.write_bytes(bytes(data))
    out = run_engine(qwen_model, "qwen3next", [PROMPT_A], tmp_path, lmcache=True, wipe=True,
                     env=_disk_env(disk), extra_args=QWEN_STEPS)
    assert out["restored"] == [0]
    assert out["tokens"] == [qwen_baseline["A"]]
    assert any("rejected" in w for w in out["warnings"]), out["warnings"]


# vLLM's own hybrid prefix caching on (mamba_cache_mode="align"): it sizes the block to the Mamba
# page (384 tokens here) and keeps one state slot per block; the adapter saves and restores the
# state in the slot of the step's last token. 600 tokens: states at every 64-token step end.
PROMPT_LONG = [(i * 37) % 900 + 3 for i in range(600)]
PROMPT_LONG_EXT = PROMPT_LONG + [5, 6, 7, 8] * 25
ALIGN = ("--align", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def qwen_long_baseline(qwen_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen-long-baseline")
    out = run_engine(qwen_model, "qwen3next", [PROMPT_LONG, PROMPT_LONG_EXT], tmp,
                     extra_args=("--max-model-len", "1024"))
    return {"A": out["tokens"][0], "EXT": out["tokens"][1]}


def _lmcache_version() -> str:
    from importlib.metadata import version

    return version("lmcache")


@pytest.mark.skipif(_lmcache_version().startswith("0.5.3"),
                    reason="base 0.25 (LMCache 0.5.3): the adapter refuses mamba_cache_mode='align' at "
                           "start-up; align mode is supported on base 0.32")
def test_qwen3next_align_mode_lmcache_with_vllm_prefix_cache(qwen_model, tmp_path, qwen_long_baseline):
    """One engine with both caches (align mode), then a NEW engine process restoring from disk.

    Engine A computes the prompt, then repeats it: vLLM's own cache holds one block (384 tokens),
    LMCache the rest up to 576 (K/V and the state at 576, put in the slot the step runs on); the
    tokens are the no-cache tokens. Engine B (new process, same disk folder, align mode) serves an
    extension of the prompt from LMCache alone. Negative control: B again with every restored
    state zeroed (a mutation in the engine process) gives different tokens."""
    env = _disk_env(tmp_path / "disk")
    a = run_engine(qwen_model, "qwen3next", [PROMPT_LONG, PROMPT_LONG], tmp_path, lmcache=True, env=env,
                   extra_args=ALIGN)
    assert a["block_size"] == 384, a["block_size"]
    assert a["hits"] == [0, 576] and a["local"] == [0, 384], (a["hits"], a["local"])
    assert a["restored"] == [0, 576] and a["cached"] == [0, 576]
    assert a["tokens"] == [qwen_long_baseline["A"]] * 2
    shutil.copytree(tmp_path / "disk", tmp_path / "disk-a")  # the control starts from the same files
    b = run_engine(qwen_model, "qwen3next", [PROMPT_LONG_EXT], tmp_path, lmcache=True, env=env,
                   extra_args=ALIGN)
    assert b["hits"] == [576] and b["restored"] == [576] and b["local"] == [0]
    assert b["tokens"] == [qwen_long_baseline["EXT"]]
    control = run_engine(qwen_model, "qwen3next", [PROMPT_LONG_EXT], tmp_path, lmcache=True,
                         env=_disk_env(tmp_path / "disk-a"), extra_args=(*ALIGN, "--zero-restored-state"))
    assert control["restored"] == [576]
    assert control["tokens"] != [qwen_long_baseline["EXT"]], "a zeroed state must change the tokens"
