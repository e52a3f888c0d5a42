"""End to end through a real ComfyUI server: miss-and-record, then hit, then a dissimilar miss."""

import pytest

from workflows import chorus_i2v_prompt

pytestmark = pytest.mark.e2e
STEPS = 4


def run_collecting_events(server, prompt):
    events = []
    record = server.run_prompt(prompt, timeout=300, on_event=events.append)
    assert record["status"]["status_str"] == "success", record["status"]
    return record, events


def chorus_report(record):
    return record["outputs"]["3"]["chorus_report"][0]


def wait_for_entries(server, bank: str, count: int, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while server.get_json(f"/chorus/api/banks/{bank}/stats")["entries"] < count:
        assert time.monotonic() < deadline, f"{bank} did not reach {count} entries in {timeout:.0f} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def three_runs(comfy_server):
    """The same bank, three requests in order; results shared by the tests below."""
    runs = {}
    for name, kwargs in [("first", dict(template="pan", subject=0, layout=0, seed=1)),
                         ("similar", dict(template="pan", subject=1, layout=0, seed=2)),
                         ("dissimilar", dict(template="orbit", subject=3, layout=5, seed=3))]:
        runs[name] = run_collecting_events(comfy_server, chorus_i2v_prompt(bank="e2e_three_runs", steps=STEPS, **kwargs))
    return runs


def test_first_request_is_a_miss_that_records(three_runs):
    report = chorus_report(three_runs["first"][0])
    assert report["mode"] == "miss"
    assert report["recorded_entry_id"]
    assert report["warnings"] == []


def test_similar_request_hits_the_recorded_entry(three_runs):
    first, similar = chorus_report(three_runs["first"][0]), chorus_report(three_runs["similar"][0])
    assert similar["mode"] == "hit"
    assert similar["entry_id"] == first["recorded_entry_id"]
    assert similar["similarity"] >= 0.9
    # a hit is sparse from step 0 to its dense last step (dense_last_steps 1, the default)
    assert [layer["sparse_share"] for layer in similar["layers"]] == [0.75, 0.75]
    assert 0 < similar["density"] < 1
    assert similar["recorded_entry_id"] is None


def test_hit_sends_one_step_event_per_step_with_per_layer_shares(three_runs):
    record, events = three_runs["similar"]
    steps = [e["data"] for e in events if e.get("type") == "chorus.step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["node"] == "3" and s["mode"] == "hit" for s in steps)
    assert steps[-1]["layers"] == chorus_report(record)["layers"]
    starts = [e["data"] for e in events if e.get("type") == "chorus.run_start"]
    report = chorus_report(record)
    assert starts == [{"node": "3", "mode": "hit", "steps": STEPS, "mask_source": report["mask_source"],
                       "entry_id": report["entry_id"], "similarity": report["similarity"],
                       "components": report["components"], "max_density": 0.6}]


def test_run_start_on_an_empty_bank_says_no_entry_was_compared(three_runs):
    """The view shows "bank: no entries yet" from the first event on, not "best similarity 0.000"."""
    _, events = three_runs["first"]
    starts = [e["data"] for e in events if e.get("type") == "chorus.run_start"]
    assert [(s["mode"], s["components"], s["max_density"]) for s in starts] == [("miss", {}, 0.6)]


def test_the_report_times_its_sparse_steps_against_its_dense_step(three_runs):
    last = "one of the last steps kept dense (dense_last_steps=1)"
    timings = chorus_report(three_runs["first"][0])["timings"]  # a miss: its dense warm-up and last steps
    assert timings["dense_step_s"] > 0 and timings["sparse_step_s"] > 0, timings
    assert chorus_report(three_runs["first"][0])["dense_steps"] == {
        "0": "dense warm-up of a miss (dense_warmup_steps=1)", "3": last}
    hit = chorus_report(three_runs["similar"][0])  # sparse from step 0, its last step dense: timed on its own
    assert hit["dense_steps"] == {"3": last}
    assert hit["timings"]["dense_step_s"] > 0 and hit["timings"]["sparse_step_s"] > 0, hit["timings"]


def test_dissimilar_request_misses(three_runs):
    report = chorus_report(three_runs["dissimilar"][0])
    assert report["mode"] == "miss"
    assert report["similarity"] < 0.9
    assert report["recorded_entry_id"]


def test_bank_routes_report_the_recorded_entries(comfy_server, three_runs):
    assert "e2e_three_runs" in comfy_server.get_json("/chorus/api/banks")["banks"]
    wait_for_entries(comfy_server, "e2e_three_runs", 2)  # the last miss's entry is written after its prompt ends
    stats = comfy_server.get_json("/chorus/api/banks/e2e_three_runs/stats")
    assert stats["entries"] == 2
    recent = comfy_server.get_json("/chorus/api/banks/e2e_three_runs/recent?limit=5")["entries"]
    assert len(recent) == 2


def test_bank_routes_take_no_paths(comfy_server):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as err:
        comfy_server.get_json("/chorus/api/banks/..%2F..%2Fetc/stats")
    assert err.value.code == 404


def test_optional_nodes_chain_in_front_of_the_sampler(comfy_server):
    """Guidance Enhance -> Feature Reuse -> Sparse Wan Sampler, in API mode, with the region map."""
    prompt = chorus_i2v_prompt(bank="e2e_optional_nodes", steps=STEPS)
    prompt["7"] = {"class_type": "ChorusGuidanceEnhance", "inputs": {
        "model": ["1", 0], "method": "cross_attention", "strength": 0.1, "start": 0.1, "end": 1.0}}
    prompt["8"] = {"class_type": "ChorusFeatureReuse", "inputs": {
        "model": ["7", 0], "positive": ["2", 0], "latent": ["2", 2], "strength": 0.5, "cell": "1x2x2",
        "start_percent": 0.3, "end_percent": 1.0, "rim": 0, "blend": True, "start_latent": ["2", 4]}}
    prompt["9"] = {"class_type": "PreviewImage", "inputs": {"images": ["8", 1]}}
    prompt["3"]["inputs"]["model"] = ["8", 0]
    record, _ = run_collecting_events(comfy_server, prompt)
    report = chorus_report(record)
    assert report["mode"] == "miss"
    # recorded steps run at full resolution, so a miss still fills the bank under feature reuse
    assert report["recorded_entry_id"] and report["warnings"] == []
    assert len(record["outputs"]["9"]["images"]) == 5  # one region map per latent frame


def test_a_match_made_for_another_latent_grid_is_refused_with_what_to_wire(comfy_server):
    """Not a silent miss that says recording "queued" while its masks can never be stored."""
    prompt = chorus_i2v_prompt(bank="e2e_other_grid", steps=STEPS)
    prompt["7"] = {"class_type": "ChorusTestbedRequest", "inputs": {
        "template": "pan", "subject": 0, "layout": 0, "latent_frames": 9, "latent_height": 16, "latent_width": 16}}
    prompt["6"]["inputs"]["latent"] = ["7", 2]
    record = comfy_server.run_prompt(prompt, timeout=300)
    assert record["status"]["status_str"] == "error"
    errors = [data for kind, data in record["status"]["messages"] if kind == "execution_error"]
    assert [(e["node_id"], e["exception_message"].rstrip("\n")) for e in errors] == [(
        "3", "Chorus Sparse Wan Sampler: the match was made for a latent of 9x8x8 tokens (frames x height x width), "
             "but the sampler got 5x8x8. Wire the same latent into Similarity Match's latent and the sampler's "
             "latent_image.")]


def test_the_default_prior_mode_through_the_server(comfy_server):
    """miss_mode "prior", the nodes' default: an empty bank predicts online and records; the next
    miss serves the population prior of what was recorded (and records, refreshing the prior after
    its entry is in); a request similar to that one then hits it."""
    def run(**kwargs):
        record, _ = run_collecting_events(comfy_server, chorus_i2v_prompt(bank="e2e_prior_default", steps=STEPS,
                                                                          miss_mode="prior", **kwargs))
        return chorus_report(record)

    first = run(template="pan", subject=0, layout=0, seed=1)
    assert (first["mode"], first["mask_source"]) == ("miss", "online prediction") and first["recorded_entry_id"]
    wait_for_entries(comfy_server, "e2e_prior_default", 1)  # written in the background after the prompt
    second = run(template="orbit", subject=3, layout=5, seed=3)
    assert (second["mode"], second["mask_source"]) == ("miss", "population prior of 1 entries")
    assert second["recorded_entry_id"] and second["warnings"] == []
    third = run(template="orbit", subject=4, layout=5, seed=4)
    assert third["mode"] == "hit" and third["entry_id"] == second["recorded_entry_id"]
