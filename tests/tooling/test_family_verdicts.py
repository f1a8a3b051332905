"""The family table's verdicts and rendering (kvstack.testbed.family_table), on made-up results: each
rule that makes a cell FAIL is shown to fire, so the engine test (tests/env/test_family_table.py)
can fail."""

from __future__ import annotations

from kvstack.testbed import family_table as ft

T = [[5, 6, 7], [5, 6, 7]]


def served(tokens=T, cached=(0, 192)):
    return {"served": True, "tokens": tokens, "cached": list(cached)}


def refused(phase="start-up", error="ValueError: no; the rest"):
    return {"served": False, "phase": phase, "error": error}


def v(stock, ours, connector="lmcache"):
    s = {("m", c): r for c, r in stock.items()}
    o = {("m", connector): ours}
    return ft.verdict("m", connector, s, o)


def test_pass_needs_stock_tokens_and_at_least_stock_hits():
    assert v({"lmcache": served()}, served())[0] == ft.PASS
    # the negative controls: another token, fewer hits, a first run that hit, a repeat that differs
    assert v({"lmcache": served()}, served(tokens=[[5, 6, 8], [5, 6, 8]]))[0] == ft.FAIL
    assert v({"lmcache": served()}, served(cached=(0, 160)))[0] == ft.FAIL
    assert v({"lmcache": served()}, served(cached=(192, 192)))[0] == ft.FAIL
    assert v({"lmcache": served()}, served(tokens=[[5, 6, 7], [5, 6, 9]]))[0] == ft.FAIL


def test_stock_serves_kvstack_refuses_is_a_failure():
    verdict, detail = v({"lmcache": served()}, refused())
    assert verdict == ft.FAIL and "stock serves, kvstack refuses: no" == detail


def test_refusals():
    assert v({"lmcache": refused()}, refused())[0] == ft.UPSTREAM
    assert v({"lmcache": refused(), "none": served()}, served())[0] == ft.KVSTACK_ONLY
    # a kvstack-only connector: refusing at start-up is by design, dying or failing later never is
    assert v({"none": served()}, refused(), "streaming")[0] == ft.BY_DESIGN
    assert v({"none": refused()}, refused(), "streaming")[0] == ft.UPSTREAM  # not the model at all
    assert v({"none": served()}, refused("died"), "streaming")[0] == ft.FAIL
    assert v({"none": served()}, refused("serving"), "multi")[0] == ft.FAIL
    # its reference is stock without a connector
    assert v({"none": served(cached=(0, 0))}, served(cached=(0, 0)), "streaming")[0] == ft.PASS
    assert v({"none": served()}, served(tokens=[[1], [1]]), "streaming")[0] == ft.FAIL


def test_why_is_the_refusals_first_clause():
    err = ("UnsupportedConfiguration: kvstack StreamingConnector: unsupported configuration:\n"
           "  - MLA attention is not supported by the windowed path; use the native path")
    assert ft._why({"error": err}) == "MLA attention is not supported by the windowed path"
    err = "ValueError: LMCache next to a connector that pages layers (['a.b']) needs one group; x"
    assert ft._why({"error": err}) == "LMCache next to a connector that pages layers needs one group"


def test_render_and_the_doc_section_round_trip():
    stock = {("llama", "none"): served(), ("llama", "lmcache"): served()}
    ours = {("llama", c): served() for c in ft.CONNECTORS}
    ours[("llama", "multi")] = refused()
    tab = ft.table("9.9", stock, ours)
    assert [r["model"] for r in tab["rows"]] == ["llama"]
    text = ft.render(tab)
    assert text == ft.render(tab) and "refused by design: no" in text and "| dense GQA" in text
    doc = "# x\n\n" + text + "\ntail\n"
    assert ft.doc_section("9.9", doc) == text
    assert ft.doc_section("1.0", doc) is None


def test_cells():
    assert ("llama", "streaming") not in ft.cells("stock")
    assert ("qwen3next", "multi") in ft.cells("kvstack")
    assert ft.cells("kvstack", ["llama"]) == [("llama", c) for c in ft.CONNECTORS]


def test_hybrid_lmcache_cells_need_their_zeroed_state_control():
    """A Mamba-style hybrid's LMCache cell runs a third time with the restored states zeroed: it
    must hit as much as the repeat and give other tokens, or the cell fails."""
    none = served(cached=(0, 0))

    def hv(tokens, cached, connector="lmcache"):
        return ft.verdict("qwen3next", connector, {("qwen3next", "none"): none},
                          {("qwen3next", connector): served(tokens, cached)})

    held = hv(T + [[9, 9, 9]], (0, 192, 192))
    assert held == (ft.KVSTACK_ONLY, "repeat 192/200 cached" + ft.CONTROLLED)
    assert hv(T, (0, 192))[0] == ft.FAIL  # the control did not run
    assert "same tokens" in hv(T + [[5, 6, 7]], (0, 192, 192))[1]  # the control failed
    assert hv(T + [[9, 9, 9]], (0, 192, 96))[0] == ft.FAIL  # it restored less
    assert hv([[5, 6, 7], [5, 6, 8], [9, 9, 9]], (0, 192, 192))[0] == ft.FAIL  # the repeat differs
    assert hv(T + [[9, 9, 9]], (0, 0, 0))[0] == ft.FAIL  # nothing restored: no state checked
    assert not ft.needs_control("qwen3next", "streaming") and not ft.needs_control("llama", "lmcache")


def test_the_same_failure_on_stock_is_shown_as_such_and_no_other():
    """Both engines start and fail the first request with the same error: "fails on stock too"
    (shown with the error); any other failure after start-up stays a FAIL."""
    boom = refused("serving", "IndexError: index 3 is out of bounds")
    got = v({"mp": refused("serving", "IndexError: index 7 is out of bounds")}, boom, "mp")
    assert got == (ft.UPSTREAM_FAULT, "index N is out of bounds")  # indices vary run to run
    assert v({"mp": served()}, boom, "mp")[0] == ft.FAIL  # stock serves it
    assert v({"mp": refused("serving", "IndexError: other")}, boom, "mp")[0] == ft.FAIL
    assert v({"mp": refused()}, boom, "mp")[0] == ft.FAIL  # stock refused at start-up
    assert v({"mp": boom}, refused("died", boom["error"]), "mp")[0] == ft.FAIL


def test_mp_cells_run_on_both_sides_with_a_chunk_of_their_block_size():
    assert ("llama", "mp") in ft.cells("stock") and ("llama", "mp") in ft.cells("kvstack")
    assert ft.family("qwen3next").mp_chunk % 32 == 0 and ft.family("llama").mp_chunk == ft.CHUNK
    from kvstack.testbed.backend_servers import lmcache_mp_server_cmd

    cmd = lmcache_mp_server_cmd(1, 384)
    assert cmd[cmd.index("--chunk-size") + 1] == "384" and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_a_table_without_the_mp_column_renders_the_columns_that_ran():
    stock = {("llama", "none"): served(), ("llama", "lmcache"): served()}
    ours = {("llama", c): served() for c in ft.CONNECTORS if c != "mp"}
    tab = ft.table("9.9", stock, ours)
    assert tab["connectors"] == [c for c in ft.CONNECTORS if c != "mp"]
    assert "LMCacheMPConnector" not in ft.render(tab) and "mp" not in tab["rows"][0]["cells"]
    assert ("llama", "mp") not in ft.cells("stock", mp=False)
