"""The demo's report explains each line: miss, hit, dissimilar miss, mask source, kept density."""

from demo import REQUESTS, density_line, kept_density, match_line, print_report, timing_line

LAYERS = [{"layer": 0, "sparse_share": 0.0, "density": None}, {"layer": 1, "sparse_share": 0.875, "density": 0.3}]


def _record(**report):
    base = {"mode": "miss", "steps": 8, "mask_source": "online prediction", "entry_id": None, "similarity": 0.0,
            "components": {}, "layers": LAYERS, "timings": {"sampling_s": 1.5}, "recorded_entry_id": None,
            "warnings": []}
    return {"status": {"status_str": "success"}, "outputs": {"3": {"chorus_report": [{**base, **report}]}}}


def test_an_empty_bank_says_no_entries_yet_instead_of_a_similarity():
    report = _record()["outputs"]["3"]["chorus_report"][0]
    assert match_line(report) == ("MISS: the bank has no entries yet for this model and latent size, so there was "
                                  "nothing to match")


def test_a_hit_and_a_dissimilar_miss_say_what_they_mean():
    assert match_line({"mode": "hit", "entry_id": "abc", "similarity": 0.9712, "components": {"clip": 1.0}}) == (
        "HIT: entry abc matched with similarity 0.971 (weighted cosine of image, text and layout signatures)")
    assert match_line({"mode": "miss", "similarity": 0.5, "components": {"clip": 0.4}}) == (
        "MISS: the most similar entry scored 0.500, below the threshold, so no entry was reused")


def test_kept_density_leaves_the_warm_up_out_and_counts_dense_layers_as_dense():
    assert kept_density({"layers": LAYERS}) == (1.0 + 0.3) / 2
    assert kept_density({"layers": [{"layer": 0, "sparse_share": 0.0, "density": None}]}) is None


def test_the_first_request_line_says_its_time_includes_loading(capsys):
    title, _, explanation = REQUESTS[0]
    print_report(title, explanation, _record(recorded_entry_id="e1"), 6.25, first=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"== {title}: success in 6.2s (includes loading the model)"
    assert "   mask source: online prediction (where this run's sparse masks came from)" in lines
    assert "   kept density: 65% of key blocks on the sparse steps (about 35% skipped)" in lines
    assert "   sampling took 1.50s" in lines
    assert "   recorded new bank entry e1: a later similar request can hit it" in lines
    assert [r[0].split(" (")[0] for r in REQUESTS] == ["first request", "similar request", "dissimilar request"]


def test_the_demo_bank_holds_every_entry_its_reports_recorded_after_the_server_stops(capsys):
    """`make demo` end to end: the server is stopped (SIGTERM) right after the last recording miss;
    the bank, read as the server left it, holds as many entries as the reports said were recorded."""
    import demo

    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("recorded new bank entry") == 2
    assert "The server has stopped; the bank holds 2 entries, and the reports recorded 2." in out


def test_the_density_line_gives_the_sparse_steps_and_the_whole_run_as_the_log_does():
    report = {"layers": LAYERS, "density": 0.7375}
    assert density_line(report) == ("kept density: 65% of key blocks on the sparse steps (about 35% skipped); "
                                    "74% over the whole run, dense steps counted as 100% (the log's density 0.74)")
    assert density_line({"layers": [{"layer": 0, "sparse_share": 0.0, "density": None}]}) == (
        "kept density: - (every attention call ran dense)")


def test_timings_are_a_sentence_not_raw_json():
    assert timing_line({"sampling_s": 2.5, "dense_step_s": 0.61, "sparse_step_s": 0.4, "match_ms": 3.0}) == (
        "sampling took 2.50s (dense step 0.61s, sparse step 0.40s)")
    assert timing_line({}) == "sampling took 0.00s"
