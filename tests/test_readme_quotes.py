"""The README quotes its results files: every number is the file's."""

import json
import re
import statistics

from conftest import REPO_ROOT

RESULTS = REPO_ROOT / "tests" / "benchmarks" / "results"
SESSION = "1bef3161b301"  # one warm H100: the 640x640 table's rows, both shapes
# README row label start -> the results row each shape column quotes (None: not measured there)
QUOTED = {
    "dense, bf16 file, cuDNN SDPA, eager": ("bf16_dense_eager", "bf16_dense_eager"),
    "dense, fp8, cuDNN SDPA, eager": ("fp8_e4m3fn_fast_dense_eager", "fp8_e4m3fn_fast_dense_eager"),
    "dense, fp8, SageAttention": ("fp8_e4m3fn_fast_dense_eager_sage", "fp8_e4m3fn_fast_dense_eager_sage"),
    "dense, fp8, TorchCompileModel": (None, "fp8_e4m3fn_fast_dense_compiled"),
    "core's Model Sparse Attention at its defaults, eager": ("fp8_e4m3fn_fast_core_eager", "fp8_e4m3fn_fast_core_eager"),
    "core's Model Sparse Attention at its defaults, TorchCompileModel": ("fp8_e4m3fn_fast_core_compiled",
                                                                          "fp8_e4m3fn_fast_core_compiled"),
    "**Chorus hit**, `dense_last_steps` 0, eager": ("fp8_e4m3fn_fast_hit_eager", "fp8_e4m3fn_fast_hit_eager"),
    "**Chorus hit**, `dense_last_steps` 0, TorchCompileModel": ("fp8_e4m3fn_fast_hit_compiled",
                                                             "fp8_e4m3fn_fast_hit_compiled"),
    "Chorus miss that records, eager": ("fp8_e4m3fn_fast_miss_eager", "fp8_e4m3fn_fast_miss_eager"),
}
SHAPES = ("user_stack_720p.json", "user_stack_640.json")
SHIPPED_SESSION = "1746da155095"  # another warm H100: the shipped default beside dense and core
# README row label start of the as-shipped table -> its results row (both shapes)
SHIPPED = {
    "dense, eager": "fp8_e4m3fn_fast_dense_eager",
    "core's Model Sparse Attention at its defaults, eager": "fp8_e4m3fn_fast_core_eager",
    "**Chorus hit as shipped** (last step dense), eager": "fp8_e4m3fn_fast_hit_last1_eager",
    "Chorus hit as shipped, TorchCompileModel": "fp8_e4m3fn_fast_hit_last1_compiled",
    "Chorus hit, `dense_last_steps` 0, eager": "fp8_e4m3fn_fast_hit_eager",
}
STACK_SESSION = "ff08f25d4bd1"  # one warm H100, three calls: every dense attention beside the FP8 hits
_H1, _H2, _H3 = (f"{STACK_SESSION}-{call}" for call in ("309cd3", "5a4c97", "43769b"))
STACK = {  # the first table: README row label -> (run id, results row)
    "ComfyUI's default on Linux: bf16 file, torch's own SDPA order (its flash kernel), eager": (_H1, "bf16_dense_eager_torch"),
    "dense, fp8, torch's own SDPA order (flash), eager": (_H2, "fp8_e4m3fn_fast_dense_eager_torch"),
    "dense, fp8, SageAttention 1.0.6 (`--use-sage-attention`), eager": (_H1, "fp8_e4m3fn_fast_dense_eager_sage"),
    "dense, fp8, cuDNN SDPA, eager": (_H1, "fp8_e4m3fn_fast_dense_eager"),
    "dense, fp8, cuDNN SDPA, TorchCompileModel": (_H2, "fp8_e4m3fn_fast_dense_compiled"),
    "dense, fp8, FlashAttention-4, eager (the fastest dense)": (_H2, "fp8_e4m3fn_fast_dense_eager_fa4"),
    "core's Model Sparse Attention at its defaults, fp8, eager": (_H1, "fp8_e4m3fn_fast_core_eager"),
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, TorchCompileModel": (_H3, "fp8_e4m3fn_fast_hit_fp8_compiled"),
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager": (_H1, "fp8_e4m3fn_fast_hit_fp8_eager"),
}
STACK_DEFAULT = "ComfyUI's default on Linux: bf16 file, torch's own SDPA order (its flash kernel), eager"
STACK_FIRST_HIT = (_H1, "fp8_e4m3fn_fast_hit_fp8_eager")  # the call's first hit: the slower of its two rows
TODAY_SESSION = "55e35e48f818"  # one warm H100, four calls: the README's first table, FA4 compiled included
_I1, _I2, _I3, _I4 = (f"{TODAY_SESSION}-{call}" for call in ("511539", "1c137b", "4172c3", "01cda9"))
_SHIPPED_FP8 = "last step dense (the shipped `dense_last_steps` 1), eager"
TODAY = {  # README row label -> (run id, results row); a call's later row of a name is its warm one
    STACK_DEFAULT: (_I3, "bf16_dense_eager_torch"),
    "dense, fp8, cuDNN SDPA, eager": (_I4, "fp8_e4m3fn_fast_dense_eager"),
    "dense, fp8, FlashAttention-4, eager": (_I2, "fp8_e4m3fn_fast_dense_eager_fa4"),
    "dense, fp8, FlashAttention-4, TorchCompileModel (the fastest dense)": (_I2, "fp8_e4m3fn_fast_dense_compiled_fa4"),
    f"Chorus hit, FP8 attention, {_SHIPPED_FP8}, no FA4": (_I1, "fp8_e4m3fn_fast_hit_last1_fp8_eager"),
    f"Chorus hit, FP8 attention, {_SHIPPED_FP8}": (_I4, "fp8_e4m3fn_fast_hit_last1_fp8_eager"),
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager": (_I3, "fp8_e4m3fn_fast_hit_fp8_eager"),
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, TorchCompileModel": (_I1, "fp8_e4m3fn_fast_hit_fp8_compiled"),
}
LEAD_SESSION = "4b838106e5e2"  # another warm H100, three calls: Chorus's other settings
_G1, _G2, _G3 = (f"{LEAD_SESSION}-{call}" for call in ("9d86f2", "0e21cf", "25335c"))
LEAD = {
    "dense, TorchCompileModel (the fastest dense)": (_G2, "fp8_e4m3fn_fast_dense_compiled"),
    "dense, eager": (_G2, "fp8_e4m3fn_fast_dense_eager"),
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, TorchCompileModel": (_G1, "fp8_e4m3fn_fast_hit_fp8_compiled"),
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager": (_G3, "fp8_e4m3fn_fast_hit_fp8_eager"),
    "Chorus hit, 16-bit attention, `dense_last_steps` 0, eager": (_G1, "fp8_e4m3fn_fast_hit_eager"),
    "Chorus hit, FP8 attention, last step dense (the shipped `dense_last_steps` 1), eager":
        (_G1, "fp8_e4m3fn_fast_hit_last1_fp8_eager"),
}
FORTY_SESSION = "d0998e714460"  # a third warm H100: 40 steps, cfg 5 at 640x640
FORTY = dict(SHIPPED, **{"Chorus miss that records, eager": "fp8_e4m3fn_fast_miss_eager"})
del FORTY["Chorus hit as shipped, TorchCompileModel"]
FA4_FORTY_SESSION = "5cd9108ad701"  # a fourth warm H100: 40 steps, cfg 5 at 640x640 against FA4
FA4_FORTY = {
    "dense, FlashAttention-4, eager (the fastest dense)": "fp8_e4m3fn_fast_dense_eager_fa4",
    "dense, cuDNN SDPA, eager": "fp8_e4m3fn_fast_dense_eager",
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager": "fp8_e4m3fn_fast_hit_fp8_eager",
    "Chorus miss that records, eager": "fp8_e4m3fn_fast_miss_eager",
}
FA4_720_FORTY_SESSION = "74217e2058fc"  # a fifth warm H100: 40 steps, cfg 1 at 720p against FA4
FA4_720_FORTY = {
    "dense, FlashAttention-4, eager (the fastest dense), counted warm": "fp8_e4m3fn_fast_dense_eager_fa4",
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager": "fp8_e4m3fn_fast_hit_fp8_eager",
    "Chorus miss that records, eager": "fp8_e4m3fn_fast_miss_eager",
}

FA4_720_CFG5_SESSION = "6a1624e477d9"  # a sixth warm H100: 40 steps, cfg 5 at 720p against FA4 in two stages
FA4_720_CFG5 = {
    "dense, FlashAttention-4, eager (the fastest dense), two stages, counted warm": "fp8_e4m3fn_fast_dense_eager_fa4",
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager": "fp8_e4m3fn_fast_hit_fp8_eager",
}


def _readme() -> str:
    return (REPO_ROOT / "README.md").read_text()


def _flat(text: str, start: str | None = None, end: str | None = None) -> str:
    """``text`` (from ``start`` to ``end`` when given) with its line breaks taken out: they are not
    part of a quote."""
    part = text[text.index(start) if start else 0:text.index(end) if end else len(text)]
    return " ".join(part.split())


def _forty_doc_text() -> str:
    """The 40-step section of FORTY_DOC, flat."""
    return _flat((REPO_ROOT / FORTY_DOC).read_text(), FORTY_MARK, FORTY_DOC_END)


def _session_rows(name: str, session: str = SESSION, steps: int = 4) -> dict:
    return {r["name"]: r for r in json.loads((RESULTS / name).read_text())["rows"]
            if r.get("session") == session and r["steps"] == steps}


def _step_s(row: dict) -> float:
    """A row's usual step in seconds: the median of its steps after the first."""
    return statistics.median(row["step_ms"][1:]) / 1e3


def _check_hit_against_fa4_text(text: str, hit: dict, fa4: dict, fastest: float) -> None:
    """The sentences both 40-step FA4 paragraphs quote: the hit counted warm, step for step, and its
    cold first step against the others."""
    assert f"about {hit['warm_seconds']:.1f} s, {fastest / hit['warm_seconds']:.3f}x" in text
    hit_step, fa4_step = _step_s(hit), _step_s(fa4)
    assert f"the hit is {fa4_step / hit_step:.2f}x FA4 ({hit_step:.2f} s against {fa4_step:.2f} s)" in text
    assert f"({hit['step_ms'][0] / 1e3:.2f} s against {hit_step:.2f} s" in text


def _counted(row: dict) -> float:
    """What the README quotes for a row: a cold first generation after a load counted warm."""
    return row.get("warm_seconds") or row["seconds"]


SHIPPED_MARK = "**As shipped, the hit keeps its last step dense**"
STACK_MARK = "**Every other attention a user can pick**"
SETTINGS_MARK = "Chorus's other settings"
SETTINGS_DOC, SETTINGS_END = "docs/benchmarks.md", "**The shipped default, measured**"
COMBINE_MARK = "**What to combine**"
OTHERS_MARK = "**At 640x640 too**"
FORTY_MARK = "**At 40 steps, cfg 5**"
FA4_FORTY_MARK = "**Against FlashAttention-4 at 40 steps**"
FA4_720_FORTY_MARK = "**At 720p, 40 steps, cfg 1**"
FA4_720_CFG5_MARK = "**At 720p, 40 steps, cfg 5**"
DEFAULT_FORTY_MARK = "**Against ComfyUI's default at 40 steps**"
COMPILED_FORTY_MARK = "**Compiled, against ComfyUI's default at 40 steps**"
BF16_MARK = "**Wan 2.1 with bf16 weights**"
SUMMARY40_MARK = "**At 40 steps** ("  # the README's 40-step summary; the tables it sums up are in FORTY_DOC
FORTY_DOC, FORTY_DOC_END = "docs/benchmarks.md", "## The fast path"


def _table_cells(labels, start: str, end: str, whole_labels: bool = True, doc: str = "README.md") -> dict:
    """Cells of the table between two markers of ``doc`` (the README unless named); a row is found
    by its whole label, or by its label's start when whole_labels is False (the first table's labels
    are starts)."""
    text = (REPO_ROOT / doc).read_text()
    part = text[text.index(start):text.index(end)]
    cells = {}
    for line in part.splitlines():
        for label in labels:
            if line.startswith(f"| {label} |" if whole_labels else f"| {label}"):
                cells[label] = [c.strip().strip("*") for c in line.strip("|").split("|")][1:]
    return cells


def test_the_speed_table_quotes_one_machines_rows_and_their_ratios():
    cells = _table_cells(QUOTED, OTHERS_MARK, SHIPPED_MARK, whole_labels=False)
    assert set(cells) == set(QUOTED)
    for column, shape in enumerate(SHAPES):
        rows = _session_rows(shape)
        fastest = min(_counted(r) for r in rows.values() if r["role"] == "dense" and r["weights"].startswith("fp8"))
        for label, names in QUOTED.items():
            seconds, ratio = cells[label][2 * column], cells[label][2 * column + 1]
            if names[column] is None:
                assert (seconds, ratio) == ("-", "-"), label
                continue
            row = rows[names[column]]
            assert float(seconds) == _counted(row), (shape, label)
            assert float(ratio.rstrip("x")) == round(fastest / _counted(row), 3), (shape, label)


def test_the_as_shipped_table_quotes_its_machines_rows_and_their_ratios():
    """Seconds, then the ratio to the dense row and to core's row of the same session and shape;
    a row not measured at a shape is "-" there."""
    cells = _table_cells(SHIPPED, SHIPPED_MARK, SUMMARY40_MARK)
    assert set(cells) == set(SHIPPED)
    for column, shape in enumerate(SHAPES):
        rows = _session_rows(shape, SHIPPED_SESSION)
        dense, core = rows["fp8_e4m3fn_fast_dense_eager"], rows["fp8_e4m3fn_fast_core_eager"]
        for label, name in SHIPPED.items():
            seconds, vs_dense, vs_core = cells[label][3 * column:3 * column + 3]
            if name not in rows:
                assert (seconds, vs_dense, vs_core) == ("-", "-", "-"), (shape, label)
                continue
            row = rows[name]
            assert float(seconds) == row["seconds"] and row.get("warm_seconds") is None, (shape, label)
            assert float(vs_dense.rstrip("x")) == round(dense["seconds"] / row["seconds"], 3), (shape, label)
            if vs_core != "-":  # core ran eager only: a compiled row has no ratio to it
                assert not row["compiled"]
                assert float(vs_core.rstrip("x")) == round(core["seconds"] / row["seconds"], 3), (shape, label)


def test_the_40_step_table_quotes_its_machines_rows_at_40_steps_cfg_5():
    """Seconds as measured (cold rows counted cold), the ratios the results file computed."""
    cells = _table_cells(FORTY, FORTY_MARK, FA4_FORTY_MARK, doc=FORTY_DOC)
    assert set(cells) == set(FORTY)
    rows = _session_rows("user_stack_640.json", FORTY_SESSION, steps=40)
    for label, name in FORTY.items():
        row = rows[name]
        assert row["cfg"] == 5.0
        assert [float(c.rstrip("x")) for c in cells[label]] == \
            [row["seconds"], row["vs_dense_same_weights"], row["vs_core_same_weights"]], label


def test_the_40_step_fa4_table_quotes_its_machines_rows_and_the_ratio_to_its_fastest_dense_run():
    """Seconds as measured, each row's ratio to the session's fastest dense run (FA4's), which the
    results file computed; the text's warm and step-for-step figures come from the hit's steps."""
    cells = _table_cells(FA4_FORTY, FA4_FORTY_MARK, FA4_720_FORTY_MARK, doc=FORTY_DOC)
    assert set(cells) == set(FA4_FORTY)
    rows = _session_rows("user_stack_640.json", FA4_FORTY_SESSION, steps=40)
    fastest = min(_counted(r) for r in rows.values() if r["role"] == "dense")
    assert fastest == rows["fp8_e4m3fn_fast_dense_eager_fa4"]["seconds"]
    for label, name in FA4_FORTY.items():
        row = rows[name]
        assert row["cfg"] == 5.0
        seconds, ratio = (float(c.rstrip("x")) for c in cells[label])
        assert (seconds, ratio) == (row["seconds"], row["vs_fastest_dense_fp8"]), label
    hit, fa4 = rows["fp8_e4m3fn_fast_hit_fp8_eager"], rows["fp8_e4m3fn_fast_dense_eager_fa4"]
    _check_hit_against_fa4_text(_forty_doc_text(), hit, fa4, fastest)


def _check_720p_fa4_table(labels: dict, start: str, end: str, session: str, cfg: float) -> dict:
    """A 720p 40-step table against FA4: FA4's row at its warm count (its first step, or each
    stage's, compiled FA4's kernel) and the fastest dense run of its cfg, the others as measured,
    each with the ratio the results file computed. Returns the session's 40-step rows by name."""
    cells = _table_cells(labels, start, end, doc=FORTY_DOC)
    assert set(cells) == set(labels)
    rows = _session_rows("user_stack_720p.json", session, steps=40)
    fa4 = rows["fp8_e4m3fn_fast_dense_eager_fa4"]
    assert min(_counted(r) for r in rows.values() if r["role"] == "dense" and r["cfg"] == cfg) == fa4["warm_seconds"]
    for label, name in labels.items():
        row = rows[name]
        assert (row["cfg"], row["shape"]) == (cfg, "720p")
        seconds, ratio = (float(c.rstrip("x")) for c in cells[label])
        expected = (fa4["warm_seconds"], 1.0) if row is fa4 else (row["seconds"], row["vs_fastest_dense_fp8"])
        assert (seconds, ratio) == expected, label
    return rows


def test_the_720p_40_step_table_quotes_its_machines_rows_against_fa4_counted_warm():
    """FA4's row at its warm count (its first step compiled FA4's kernel), the others as measured,
    each with the ratio the results file computed; the text's figures come from the rows' steps."""
    rows = _check_720p_fa4_table(FA4_720_FORTY, FA4_720_FORTY_MARK, FA4_720_CFG5_MARK, FA4_720_FORTY_SESSION, 1.0)
    fa4, hit = rows["fp8_e4m3fn_fast_dense_eager_fa4"], rows["fp8_e4m3fn_fast_hit_fp8_eager"]
    text = _forty_doc_text()
    _check_hit_against_fa4_text(text, hit, fa4, fa4["warm_seconds"])
    assert f"(its first step, {fa4['step_ms'][0] / 1e3:.2f} s, compiled FA4's kernel)" in text
    assert f"({hit['step_ms'][0] / 1e3:.2f} s against {_step_s(hit):.2f} s for the others)" in text
    miss = rows["fp8_e4m3fn_fast_miss_eager"]
    assert f"is {miss['vs_fastest_dense_fp8']:.3f}x FA4" in text
    assert f"online sparse steps ({_step_s(miss):.2f} s)" in text
    limits = _flat(_readme())
    assert f"a miss is faster than dense: {miss['vs_fastest_dense_fp8']:.3f}x FA4 at 720p, cfg 1" in limits
    assert f"At 720p, 40 steps, cfg 1 it is {hit['vs_fastest_dense_fp8']:.3f}x FA4" in limits


def test_the_720p_cfg_5_table_quotes_fa4s_joined_stages_counted_warm_and_the_hit_as_measured():
    """FA4's dense run joined from its two staged calls, at its warm count (each stage's first step
    compiled FA4's kernel); the hit as measured with the ratio the results file computed; the text's
    figures come from the rows' steps, and the miss that recorded the entry ran at cfg 1."""
    rows = _check_720p_fa4_table(FA4_720_CFG5, FA4_720_CFG5_MARK, DEFAULT_FORTY_MARK, FA4_720_CFG5_SESSION, 5.0)
    fa4, hit = rows["fp8_e4m3fn_fast_dense_eager_fa4"], rows["fp8_e4m3fn_fast_hit_fp8_eager"]
    assert [p["stage"] for p in fa4["stages"]] == [[0, 20], [20, 40]]
    text = _forty_doc_text()
    _check_hit_against_fa4_text(text, hit, fa4, fa4["warm_seconds"])
    assert f"counted warm it took {fa4['warm_seconds']:.3f} s ({fa4['seconds']:.3f} s as measured)" in text
    assert f"({hit['step_ms'][0] / 1e3:.2f} s against {_step_s(hit):.2f} s for the others)" in text
    assert f"That misses the 3.0x target by {round(100 * (1 - hit['vs_fastest_dense_fp8'] / 3.0))} %" in text
    miss = rows["fp8_e4m3fn_fast_miss_eager"]
    assert (miss["cfg"], hit["entry_recorded_cfg"]) == (1.0, 1.0)
    assert f"a miss at cfg 1 ({miss['seconds']} s;" in text
    limits = _flat(_readme())
    assert f"and at cfg 5 {hit['vs_fastest_dense_fp8']:.3f}x ({_step_s(fa4) / _step_s(hit):.2f}x step for step)" in limits


DEFAULT_FORTY_SESSION = "2af65dd3579f"  # a seventh warm H100: 40 steps, cfg 5 at 640x640 against ComfyUI's default
DEFAULT_FORTY = {  # table label -> results row; ComfyUI's default joined from two staged calls
    "ComfyUI's default on Linux: bf16 file, torch's own SDPA order, eager, two stages, counted warm":
        "bf16_dense_eager_torch",
    "dense, fp8, cuDNN SDPA, eager (the fastest dense here), counted warm": "fp8_e4m3fn_fast_dense_eager",
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager, the entry recorded at cfg 5":
        "fp8_e4m3fn_fast_hit_fp8_eager",
    "Chorus miss that records, eager, at cfg 5": "fp8_e4m3fn_fast_miss_eager",
}


def test_the_40_step_table_against_comfyuis_default_quotes_its_machines_rows_and_both_ratios():
    """Dense rows counted warm (ComfyUI's default from its two stages), Chorus's as measured; each
    against the session's fastest dense run and ComfyUI's default; the text's figures from the
    rows' steps, and the README's sentence the same figures."""
    cells = _table_cells(DEFAULT_FORTY, DEFAULT_FORTY_MARK, COMPILED_FORTY_MARK, doc=FORTY_DOC)
    assert set(cells) == set(DEFAULT_FORTY)
    rows = _session_rows("user_stack_640.json", DEFAULT_FORTY_SESSION, steps=40)
    default, dense = rows["bf16_dense_eager_torch"], rows["fp8_e4m3fn_fast_dense_eager"]
    hit = rows["fp8_e4m3fn_fast_hit_fp8_eager"]
    assert [p["stage"] for p in default["stages"]] == [[0, 20], [20, 40]]
    assert all(r["cfg"] == 5.0 and not r["compiled"] for r in rows.values()) and hit["entry_recorded_cfg"] == 5.0
    fastest = min(_counted(r) for r in rows.values() if r["role"] == "dense" and r["weights"] != "bf16")
    assert fastest == _counted(dense)
    for label, name in DEFAULT_FORTY.items():
        row = rows[name]
        quoted = _counted(row) if row["role"] == "dense" else row["seconds"]  # the miss, too, as measured
        seconds, vs_fastest, vs_default = (float(c.rstrip("x")) for c in cells[label])
        assert (seconds, vs_fastest, vs_default) == (
            quoted, round(fastest / quoted, 3), round(_counted(default) / quoted, 3)), label
    ratio = _counted(default) / hit["seconds"]
    assert (hit["vs_fastest_dense_fp8"], hit["vs_dense_bf16"]) == (round(fastest / hit["seconds"], 3), round(ratio, 3))
    text = _flat((REPO_ROOT / FORTY_DOC).read_text(), DEFAULT_FORTY_MARK, COMPILED_FORTY_MARK)
    assert f"counted warm it took {default['warm_seconds']} s ({default['seconds']} s as measured)" in text
    assert f"is **{ratio:.3f}x**: the 4.5x target is missed by {round(100 * (1 - ratio / 4.5))} %" in text
    hit_step, default_step, dense_step = _step_s(hit), _step_s(default), _step_s(dense)
    assert (f"Step for step the hit is {default_step / hit_step:.2f}x ComfyUI's default ({hit_step:.2f} s against "
            f"{default_step:.2f} s) and {dense_step / hit_step:.2f}x dense fp8 with cuDNN ({dense_step:.2f} s)") in text
    readme = _flat(_readme())
    assert (f"{default['seconds']} s ({default['warm_seconds']} s counted warm) against the FP8 hit's "
            f"{hit['seconds']} s, **{ratio:.3f}x**") in readme
    assert f"the same hit is {fastest / hit['seconds']:.3f}x dense fp8 with cuDNN ({fastest} s)" in readme
    assert f"it is {ratio:.3f}x eager and " in readme


COMPILED_FORTY_SESSION = "554e70201614"  # an eighth warm H100: the compiled rows beside ComfyUI's default
COMPILED_FORTY = {  # table label -> results row
    "ComfyUI's default on Linux, eager as it runs without TorchCompileModel, two stages, counted warm":
        "bf16_dense_eager_torch",
    "dense, fp8, FlashAttention-4, TorchCompileModel (the fastest dense here), counted warm":
        "fp8_e4m3fn_fast_dense_compiled_fa4",
    "**Chorus hit, FP8 attention**, `dense_last_steps` 0, TorchCompileModel": "fp8_e4m3fn_fast_hit_fp8_compiled",
    "Chorus hit, FP8 attention, `dense_last_steps` 0, eager, the process's first hit": "fp8_e4m3fn_fast_hit_fp8_eager",
    "Chorus miss that records, eager": "fp8_e4m3fn_fast_miss_eager",
}


def test_the_compiled_40_step_table_quotes_its_machines_rows_and_both_ratios():
    """Dense rows counted warm (FA4's timed run compiled a graph, its warm count takes that step at
    the median), Chorus's as measured; each against the session's fastest dense run and ComfyUI's
    default; the text's figures and the README's sentences from the same rows."""
    cells = _table_cells(COMPILED_FORTY, COMPILED_FORTY_MARK, FORTY_DOC_END, doc=FORTY_DOC)
    assert set(cells) == set(COMPILED_FORTY)
    rows = _session_rows("user_stack_640.json", COMPILED_FORTY_SESSION, steps=40)
    default, fa4 = rows["bf16_dense_eager_torch"], rows["fp8_e4m3fn_fast_dense_compiled_fa4"]
    hit, eager = rows["fp8_e4m3fn_fast_hit_fp8_compiled"], rows["fp8_e4m3fn_fast_hit_fp8_eager"]
    assert [p["stage"] for p in default["stages"]] == [[0, 20], [20, 40]] and fa4["graphs"] == 1
    assert (hit["compiled"], hit["graphs"], hit["entry_recorded_cfg"]) == (True, 0, 5.0)
    fastest = min(_counted(r) for r in rows.values() if r["role"] == "dense" and r["weights"] != "bf16")
    assert fastest == _counted(fa4)
    for label, name in COMPILED_FORTY.items():
        row = rows[name]
        quoted = _counted(row) if row["role"] == "dense" else row["seconds"]
        seconds, vs_fastest, vs_default = (float(c.rstrip("x")) for c in cells[label])
        assert (seconds, vs_fastest, vs_default) == (
            quoted, round(fastest / quoted, 3), round(_counted(default) / quoted, 3)), label
    ratio, vs_fa4 = _counted(default) / hit["seconds"], fastest / hit["seconds"]
    text = _flat((REPO_ROOT / FORTY_DOC).read_text(), COMPILED_FORTY_MARK, FORTY_DOC_END)
    assert f"{default['warm_seconds']} s counted warm ({default['seconds']} s as measured)" in text
    assert f"{fa4['warm_seconds']} s counted warm, {fa4['seconds']} s as measured" in text
    assert f"is **{ratio:.3f}x** ComfyUI's default: the 4.5x target is missed by {round(100 * (1 - ratio / 4.5))} %" in text
    assert f"a step of {_counted(default) / 4.5 / 40:.2f} s where the compiled hit's takes {_step_s(hit):.2f} s" in text
    assert f"it is {vs_fa4:.3f}x: the 3.0x target is missed by {round(100 * (1 - vs_fa4 / 3.0))} %" in text
    assert (f"Step for step the compiled hit is {_step_s(default) / _step_s(hit):.2f}x ComfyUI's default and "
            f"{_step_s(fa4) / _step_s(hit):.2f}x compiled FA4") in text
    assert f"took {eager['seconds']} s here" in text and f"{_counted(default) / eager['seconds']:.3f}x the default" in text
    assert f"cost the hit's process {hit['compile_s']:.1f} s once" in text and f"FA4's {fa4['compile_s']:.1f} s" in text
    readme = _flat(_readme())
    assert (f"the hit took {hit['seconds']} s against ComfyUI's default's {default['warm_seconds']} s counted warm, "
            f"**{ratio:.3f}x**, and {vs_fa4:.3f}x dense FlashAttention-4 compiled ({fastest} s)") in readme
    assert f"and {ratio:.3f}x under TorchCompileModel (on another machine), not the 4.5x set" in readme


DYNAMIC_MARK = f"Session `{DEFAULT_FORTY_SESSION}` (H100, commit 4b88315"  # the same machine: both loaders
DYNAMIC_END = "### At 40 steps on the user's stack"
DYNAMIC = {  # table label -> results row (under DynamicVRAM the same name ends in _dynamic_vram)
    "dense, cuDNN SDPA, eager, counted warm": "fp8_e4m3fn_fast_dense_eager",
    "ComfyUI's default on Linux: bf16 file, torch's own SDPA order, eager, counted warm": "bf16_dense_eager_torch",
    "Chorus miss that records, eager": "fp8_e4m3fn_fast_miss_eager",
    "Chorus hit, 16-bit attention, `dense_last_steps` 0, eager": "fp8_e4m3fn_fast_hit_eager",
    "Chorus hit, FP8 attention, `dense_last_steps` 0, eager": "fp8_e4m3fn_fast_hit_fp8_eager",
}


def test_the_dynamic_vram_table_quotes_one_machines_rows_on_both_loaders():
    """Each loader's column: the row counted warm where it was its model's first generation, and its
    ratio to that loader's dense fp8 row; the text's step figures from the rows' steps."""
    cells = _table_cells(DYNAMIC, DYNAMIC_MARK, DYNAMIC_END, doc=FORTY_DOC)
    assert set(cells) == set(DYNAMIC)
    rows = _session_rows("user_stack_640.json", DEFAULT_FORTY_SESSION)
    for column, suffix in enumerate(("_dynamic_vram", "")):
        dense = rows["fp8_e4m3fn_fast_dense_eager" + suffix]
        for label, name in DYNAMIC.items():
            row = rows[name + suffix]
            assert row["memory"] == ("dynamic_vram" if suffix else "legacy") and row["cfg"] == 1.0
            seconds, ratio = (float(c.rstrip("x")) for c in cells[label][2 * column:2 * column + 2])
            assert (seconds, ratio) == (_counted(row), round(_counted(dense) / _counted(row), 3)), (suffix, label)
    text = _flat((REPO_ROOT / FORTY_DOC).read_text(), DYNAMIC_MARK, DYNAMIC_END)
    step = {k: _step_s(r) for k, r in rows.items()}
    assert (f"(dense {step['fp8_e4m3fn_fast_dense_eager_dynamic_vram']:.2f} s against "
            f"{step['fp8_e4m3fn_fast_dense_eager']:.2f} s, the 16-bit hit "
            f"{step['fp8_e4m3fn_fast_hit_eager_dynamic_vram']:.2f} s against {step['fp8_e4m3fn_fast_hit_eager']:.2f} s)") in text
    assert (f"the bf16 file, did not ({step['bf16_dense_eager_torch_dynamic_vram']:.2f} s against "
            f"{step['bf16_dense_eager_torch']:.2f} s)") in text
    hit = rows["fp8_e4m3fn_fast_hit_fp8_eager_dynamic_vram"]
    assert f"its first step ({hit['step_ms'][0] / 1e3:.2f} s against {hit['step_ms'][1] / 1e3:.2f} s for the next)" in text


# the README's 40-step summary: row label -> (results file, session, cfg)
SUMMARY40 = {
    "640x640, cfg 5 (session `5cd9108ad701`)": ("user_stack_640.json", FA4_FORTY_SESSION, 5.0),
    "720p, cfg 1 (session `74217e2058fc`)": ("user_stack_720p.json", FA4_720_FORTY_SESSION, 1.0),
    "720p, cfg 5 (session `6a1624e477d9`)": ("user_stack_720p.json", FA4_720_CFG5_SESSION, 5.0),
}


def test_the_readmes_40_step_summary_quotes_each_machines_fa4_run_its_hit_and_their_ratios():
    """Each row: FA4's dense run at the count the results file divides by (warm where its first
    step compiled FA4's kernel), the FP8 hit as measured, the ratio the file computed and the
    ratio of their median steps."""
    cells = _table_cells(SUMMARY40, SUMMARY40_MARK, BF16_MARK)
    assert set(cells) == set(SUMMARY40)
    for label, (results, session, cfg) in SUMMARY40.items():
        rows = _session_rows(results, session, steps=40)
        fa4, hit = rows["fp8_e4m3fn_fast_dense_eager_fa4"], rows["fp8_e4m3fn_fast_hit_fp8_eager"]
        assert (fa4["cfg"], hit["cfg"]) == (cfg, cfg)
        fa4_s, hit_s, ratio, step_ratio = (float(c.rstrip("x")) for c in cells[label])
        assert (fa4_s, hit_s, ratio) == (_counted(fa4), hit["seconds"], hit["vs_fastest_dense_fp8"]), label
        assert step_ratio == round(_step_s(fa4) / _step_s(hit), 2), label
        assert hit["vs_fastest_dense_fp8"] == round(_counted(fa4) / hit["seconds"], 3), label
    text = _flat(_readme(), SUMMARY40_MARK, BF16_MARK)
    shipped = _session_rows("user_stack_640.json", FORTY_SESSION, steps=40)["fp8_e4m3fn_fast_hit_last1_eager"]
    assert (f"a 640x640 hit at cfg 5 is {shipped['vs_dense_same_weights']:.3f}x cuDNN dense and "
            f"{shipped['vs_core_same_weights']:.3f}x core's Model Sparse Attention (session `{FORTY_SESSION}`)") in text
    miss = _session_rows("user_stack_720p.json", FA4_720_FORTY_SESSION, steps=40)["fp8_e4m3fn_fast_miss_eager"]
    assert f"a miss that records is faster than dense ({miss['vs_fastest_dense_fp8']:.3f}x FA4 at 720p, cfg 1)" in text


def _run_rows(session: str) -> dict:
    """A session's 720p rows by (run id, name): a call's later row of a name is its warm one."""
    return {(r["run"], r["name"]): r for r in json.loads((RESULTS / "user_stack_720p.json").read_text())["rows"]
            if r.get("session") == session}


def _check_stack_table(table: dict, rows: dict, cells: dict, fastest_label: str) -> tuple[float, float]:
    """A first-kind table: each row's seconds (counted warm), its ratio to the session's fastest dense
    fp8 run (the row ``fastest_label``) and to ComfyUI's Linux default; returns (fastest, default)."""
    assert set(cells) == set(table)
    fastest = min(_counted(r) for r in rows.values() if r["role"] == "dense" and r["weights"] != "bf16")
    assert fastest == _counted(rows[table[fastest_label]])
    default_row = rows[table[STACK_DEFAULT]]
    assert default_row["attention"] == "torch_sdpa_default_order" and default_row["weights"] == "bf16"
    default = _counted(default_row)
    for label, key in table.items():
        row = rows[key]
        assert (row["steps"], row["cfg"], row["shape"]) == (4, 1.0, "720p"), label
        assert [float(c.rstrip("x")) for c in cells[label]] == \
            [_counted(row), round(fastest / _counted(row), 3), round(default / _counted(row), 3)], label
    return fastest, default


def test_the_other_attentions_table_quotes_one_machines_rows_against_its_fastest_dense_run_and_comfyuis_default():
    """Every dense attention a user can pick, core and the FP8 hits, from one warm machine's calls;
    rows that were their model's first generation are counted warm, as the results file counts them."""
    rows = _run_rows(STACK_SESSION)
    _check_stack_table(STACK, rows, _table_cells(STACK, STACK_MARK, SETTINGS_MARK),
                       "dense, fp8, FlashAttention-4, eager (the fastest dense)")
    text = _flat(_readme())
    in_call = [r for r in json.loads((RESULTS / "user_stack_720p.json").read_text())["rows"]
               if (r["run"], r["name"]) == STACK_FIRST_HIT]  # the table quotes the second, warm one
    assert len(in_call) == 2 and in_call[0]["seconds"] > in_call[1]["seconds"] == rows[STACK_FIRST_HIT]["seconds"]
    assert f"a process's first hit also loads its Triton kernels ({in_call[0]['seconds']} s in the same call)" in text
    for measured in ("bf16_dense_eager_torch", "fp8_e4m3fn_fast_dense_eager_fa4"):  # the two counted warm
        row = next(r for r in rows.values() if r["name"] == measured)
        assert row["warm_seconds"] is not None and f"{row['seconds']} s" in text, measured


def test_the_first_table_is_one_machines_rows_with_fa4_compiled_its_fastest_dense_run():
    """Today's stack on one warm machine: the fastest dense run a user can have (FA4 under
    TorchCompileModel, measured as a row here) and ComfyUI's Linux default, against the FP8 hits;
    the text's figures are the same rows'."""
    rows = _run_rows(TODAY_SESSION)
    fastest, default = _check_stack_table(TODAY, rows, _table_cells(TODAY, "## Speed", STACK_MARK),
                                          "dense, fp8, FlashAttention-4, TorchCompileModel (the fastest dense)")
    default_row = rows[TODAY[STACK_DEFAULT]]
    text = _flat(_readme())
    best = rows[TODAY["**Chorus hit, FP8 attention**, `dense_last_steps` 0, TorchCompileModel"]]
    assert f"{default / best['seconds']:.2f}x ComfyUI's default but {fastest / best['seconds']:.2f}x the fastest" in text
    assert f"{default_row['seconds']} s as measured" in text
    first_hit = next(r for r in json.loads((RESULTS / "user_stack_720p.json").read_text())["rows"]
                     if (r["run"], r["name"]) == TODAY["**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager"])
    assert first_hit["seconds"] > rows[TODAY["**Chorus hit, FP8 attention**, `dense_last_steps` 0, eager"]]["seconds"]
    assert f"a process's first FP8 hit also loads its Triton kernels ({first_hit['seconds']} s in the same call)" in text
    # the dense last step: FA4 where installed, else cuDNN first, also under torch's own order
    last_steps = [round(rows[key]["step_ms"][-1] / 1000, 2) for key in (
        TODAY[f"Chorus hit, FP8 attention, {_SHIPPED_FP8}"], TODAY[f"Chorus hit, FP8 attention, {_SHIPPED_FP8}, no FA4"],
        (_I1, "fp8_e4m3fn_fast_hit_last1_fp8_eager_torch"))]
    assert "dense last step ran FA4 ({:.2f} s)".format(last_steps[0]) in text
    assert "torch SDPA with cuDNN first ({:.2f} s), also when ComfyUI itself was left on torch's own order " \
           "({:.2f} s,".format(*last_steps[1:]) in text


def test_the_settings_table_quotes_another_machines_fastest_rows_and_their_ratios():
    """Chorus's other settings (in the benchmarks page, linked from the README): one warm machine's calls; a row is named by its call's run id,
    because the machine ran some arms in two calls (a process's first FP8 hit also loads its kernels)."""
    cells = _table_cells(LEAD, SETTINGS_MARK, SETTINGS_END, doc=SETTINGS_DOC)
    assert set(cells) == set(LEAD)
    rows = _run_rows(LEAD_SESSION)
    fastest = min(r["seconds"] for r in rows.values() if r["role"] == "dense")
    assert fastest == rows[LEAD["dense, TorchCompileModel (the fastest dense)"]]["seconds"]
    for label, key in LEAD.items():
        row = rows[key]
        assert (row["steps"], row["cfg"], row["weights"]) == (4, 1.0, "fp8_e4m3fn_fast"), label
        assert [float(c.rstrip("x")) for c in cells[label]] == [row["seconds"], round(fastest / row["seconds"], 3)], label


def test_the_text_quotes_the_hit_against_core_and_the_fp8_scaled_hit():
    text = _flat(_readme())
    ratios = []
    for shape in SHAPES:
        rows = _session_rows(shape, SHIPPED_SESSION)
        core = rows["fp8_e4m3fn_fast_core_eager"]["seconds"]
        ratios.append((core / rows["fp8_e4m3fn_fast_hit_last1_eager"]["seconds"],
                       core / rows["fp8_e4m3fn_fast_hit_eager"]["seconds"]))
    (shipped_720, fastest_720), (shipped_640, fastest_640) = ratios
    assert f"{shipped_720:.2f}x core's speed at 720p and {shipped_640:.2f}x at 640x640" in text
    assert f"{fastest_720:.2f}x and {fastest_640:.2f}x core's speed" in text
    assert f"({fastest_720:.2f}x core at 720p, {fastest_640:.2f}x at 640x640)" in text
    scaled = _session_rows("user_stack_640.json")["fp8_scaled_hit_eager"]["seconds"]
    assert f"a hit in {scaled} s at 640x640" in text


def test_the_core_quality_table_is_the_files():
    row = json.loads((RESULTS / "product_path_entropy16k_core_sparse_h100" / "core_sparse.json").read_text())["rows"][0]
    text = _readme()
    assert f"| {row['hit_psnr_db']:.2f} ± {row['hit_psnr_db_ci95']:.2f} |" in text
    for arm in ("defaults", "matched"):
        psnr, diff = row[f"core_{arm}_psnr_db"], row[f"hit_minus_core_{arm}_db"]
        assert f"| {psnr:.2f} ± {row[f'core_{arm}_psnr_db_ci95']:.2f} | {diff:.2f} ± " \
               f"{row[f'hit_minus_core_{arm}_db_ci95']:.2f} |" in text, arm
    defaults = row["hit_minus_core_defaults_db"]
    assert f"{-defaults:.2f} dB further from dense" in " ".join(text.split())  # the limits line


def test_the_last_step_dense_figure_is_the_quality_tables():
    table = (RESULTS / "product_path_entropy16k_step9159_h200" / "quality_table.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| natural_4step_last1 |"))
    psnr = [c.strip() for c in line.strip("|").split("|")][5]
    assert f"{psnr.replace(' ± ', ' ±')}" in _flat(_readme()).replace(" ± ", " ±")
    core = json.loads((RESULTS / "product_path_entropy16k_core_sparse_h100" / "core_sparse.json").read_text())
    ahead = float(psnr.split(" ± ")[0]) - core["rows"][0]["core_defaults_psnr_db"]
    assert f"{ahead:.2f} dB over core at its defaults" in _flat(_readme())


def test_how_the_bank_grows_quotes_the_lifecycle_results():
    rows = {r["policy"]: r for r in json.loads((RESULTS / "bank_lifecycle.json").read_text())["rows"]
            if r.get("final")}
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## How the bank grows"):text.index("## ComfyUI versions")]
    none, merge = rows["none"], rows["merge"]
    assert f"left alone, {none['entries']} entries\nand a {none['hit_rate']:.3f} hit rate" in section
    assert f"merging near-copies, {merge['entries']} entries" in section
    assert f"over {none['kinds_seen']} kinds of request" in section.replace("\n", " ")
    assert round(merge["hit_rate"], 3) == round(none["hit_rate"], 3)  # "at the same hit rate"
    for policy, words in (("budget_50", "at half the unbounded size"), ("budget_25", "at a quarter"),
                          ("budget_10", "at a tenth")):
        assert f"{rows[policy]['hit_rate']:.3f} {words}" in section.replace("\n  ", " "), policy
