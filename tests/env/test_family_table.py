"""Never worse than stock (issue 27), as a table: model families x KV connectors, stock vLLM +
LMCache (kvstack's vLLM series taken out again) vs kvstack, on the base in effect.

kvstack.testbed.family_table runs the cells (one engine process per side, the cells one engine
after another) and gives each a verdict; this test fails on any FAIL cell (above all "stock serves,
kvstack refuses"), checks the control that the stock side really ran stock's code, and checks that
docs/family-table.md holds this run's table for the base (rendered from the results, never by
hand: `python -m kvstack.testbed.family_table publish` writes it from build/family-table/*.json).

The stock side's results come from kvstack.testbed.side_cache when the same cells ran before with
nothing they depend on changed (KVSTACK_STOCK_CACHE=0 runs them); kvstack's side always runs.

Replaces test_window_models_lmcache.py (Gemma-2 and chunked-local Llama-4 with LMCache, stock vs
kvstack: now the table's lmcache column, with the same control).
"""

from __future__ import annotations

import json
import os

import pytest

from kvtest import on_default_base

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from kvstack.testbed import family_table as ft  # noqa: E402

pytestmark = pytest.mark.env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both sides' results for every cell: ({cell: result} stock, {cell: result} kvstack)."""
    from kvstack.testbed.tiny_models import engine_crash_reason

    tmp = tmp_path_factory.mktemp("family")
    models = tmp / "models"
    # a model vLLM's CPU engine cannot run on this host at all (stock or not) is left out
    runnable = [f.model for f in ft.FAMILIES if engine_crash_reason(f.model) is None]
    ft.make_models(runnable, models)  # the hybrids with a long-memory state
    stock_dir = ft.build_stock_overlay(tmp / "stock-overlay")
    log = tmp / "engines.log"
    mp = _mp_column()
    from kvstack.release.pins import default_base

    base = os.environ.get("KVSTACK_BASE") or default_base()
    stock, how = ft.run_stock_side(ft.cells("stock", runnable, mp=mp), models, overlay_dir=stock_dir,
                                   log=log, base=base)
    print(how)  # and in build/family-table/<base>-stock.txt: whether this run's stock side ran
    ft.OUT_DIR.mkdir(parents=True, exist_ok=True)
    (ft.OUT_DIR / f"{base}-stock.txt").write_text(how + "\n")
    ours = ft.run_side("kvstack", ft.cells("kvstack", runnable, mp=mp), models, overlay_dir=None,
                       log=log)
    return stock, ours


def _mp_column() -> bool:
    """The LMCacheMPConnector column runs on the default base only (CI time; on base 0.25 LMCache
    0.5.3's MP route is tests/env/lmcache/test_mp_route.py's)."""
    return on_default_base()


@pytest.fixture(scope="module")
def table(runs):
    from kvstack.release.pins import default_base

    base = os.environ.get("KVSTACK_BASE") or default_base()
    tab = ft.table(base, *runs, host=ft.host_class())
    ft.OUT_DIR.mkdir(parents=True, exist_ok=True)
    (ft.OUT_DIR / f"{base}.json").write_text(json.dumps(tab, indent=1) + "\n")
    (ft.OUT_DIR / f"{base}.md").write_text(ft.render(tab))
    print("\n" + ft.render(tab))
    return tab


@pytest.mark.parametrize("cell", [f"{m}-{c}" for m, c in ft.cells("kvstack")])
def test_cell(cell, table):
    from kvstack.testbed.tiny_models import engine_crash_reason

    model, connector = cell.rsplit("-", 1)
    if engine_crash_reason(model):
        pytest.skip(engine_crash_reason(model))
    if connector not in table["connectors"]:
        pytest.skip(f"the {ft.HEADERS[connector]} column runs on the default base only")
    row = next(r for r in table["rows"] if r["model"] == model)
    got = row["cells"][connector]
    assert got["verdict"] != ft.FAIL, f"{row['family']} with {ft.HEADERS[connector]}: {got['detail']}"


def test_hybrid_cells_ran_their_zeroed_state_control(runs):
    """Every hybrid LMCache cell kvstack served ran its negative control (a third run with the
    restored states zeroed; the verdict fails the cell unless it restored as much and changed the
    tokens): the table's "same tokens" for a restored hybrid state is a comparison that can fail."""
    _, ours = runs
    # models this base's engine runs at all here (its "none" cell served): base 0.25 refuses
    # Granite-4, and its Qwen3-Next kernel dies on AMX hosts (engine_crash_reason)
    hybrid = [k for k in ours if ft.needs_control(*k) and ours.get((k[0], "none"), {}).get("served")]
    if not hybrid:
        pytest.skip("no Mamba-style hybrid runs on this host")
    controlled = [k for k in hybrid if ours[k]["served"]]
    assert controlled, "no hybrid LMCache cell served: nothing restored a state"
    for key in controlled:
        assert len(ours[key]["tokens"]) == 3 and ours[key]["tokens"][2] != ours[key]["tokens"][1], key


def test_the_stock_side_ran_stock(runs):
    """The control: the stock side ran stock's LMCacheConnectorV1 (no hybrid-manager support, so
    vLLM turned the manager off itself) and kvstack's supports it (and keeps it only for
    Mamba-style hybrids); otherwise both sides ran the same code and no cell could fail."""
    stock, ours = runs
    served = [(k, r) for k, r in stock.items() if r["served"] and k[1] == "lmcache"]
    assert served, "stock served no LMCache cell: the table compares nothing"
    for (model, _), r in served:
        assert not r["lmcache_supports_hma"] and r["hma_off"], (model, r)
    for (model, conn), r in ours.items():
        if r["served"] and conn == "lmcache":
            assert r["lmcache_supports_hma"], (model, r)
            # the hybrid manager stays on for the Mamba-style hybrids only
            assert r["hma_off"] == (model not in ("qwen3next", "granite4")), (model, r)


def test_the_docs_hold_this_run(table):
    rendered = ft.render(table)
    committed = ft.doc_section(table["base"])
    if committed is not None and f"CPU engine, {table['host']}\n" not in committed:
        # vLLM's CPU engine takes other kernels and block sizes with AMX: the committed table is
        # another host class's (the cells' verdicts above are this host's, and must not FAIL)
        pytest.skip(f"docs/family-table.md holds base {table['base']}'s table of another host class "
                    f"than this one ({table['host']}); this run's:\n{rendered}")
    assert committed == rendered, (
        f"{ft.DOC.relative_to(ft.REPO)} does not hold this run's table for base {table['base']}: "
        "run `python -m kvstack.testbed.family_table publish` and commit it.\nThis run:\n" + rendered)


def test_hybrid_model_keeps_the_hybrid_manager():
    """The fallback is for models without state: a Mamba-style hybrid keeps the manager (its
    state groups are what kvstack's LMCache patches restore)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    class Cfg:
        def __init__(self, hybrid):
            self.is_hybrid = hybrid

    assert LMCacheConnectorV1.hma_fallback_reason(Cfg(True)) is None
    assert LMCacheConnectorV1.hma_fallback_reason(None) is None
    assert "Mamba" in LMCacheConnectorV1.hma_fallback_reason(Cfg(False))
