"""The Chorus nodes in-process (CPU): loaded as ComfyUI loads the pack, executed directly."""

import importlib.util
import sys
import traceback

import pytest
import torch

from conftest import REPO_ROOT

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def pack(comfy_runtime, tmp_path_factory):
    """The pack imported under a path-like module name, as ComfyUI's loader does."""
    import folder_paths

    banks = tmp_path_factory.mktemp("banks")
    folder_paths.folder_names_and_paths["chorus_banks"] = ([str(banks)], set())
    name = str(REPO_ROOT).replace(".", "_x_") + "_inprocess"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    from importlib import import_module

    return import_module(f"{name}.nodes.bank_nodes"), import_module(f"{name}.nodes.sampler_nodes"), \
        import_module(f"{name}.nodes.testbed"), banks


def request_outputs(testbed, template="pan", subject=0, layout=0):
    return testbed.ChorusTestbedRequest.execute(template, subject, layout, 5, 16, 16).args


def generate(pack, patcher, bank_name, template="pan", subject=0, layout=0, seed=0, steps=3):
    bank_nodes, sampler_nodes, testbed, _ = pack
    positive, negative, latent, clip, start = request_outputs(testbed, template, subject, layout)
    (bank,) = bank_nodes.ChorusMaskBankLoader.execute(bank_nodes.NEW_BANK, bank_name, False).args
    match, summary = bank_nodes.ChorusSimilarityMatch.execute(bank, patcher, positive, latent, 0.9, 0.5, 0.3, 0.2,
                                                              32, start_latent=start, clip_vision_output=clip).args
    output = sampler_nodes.ChorusSparseWanSampler.execute(
        patcher, positive, negative, latent, seed, steps, 5.0, "euler", "simple", 1.0, 1, "", "online", 0.9, 0.1, 0.6,
        True, template, match=match)
    flush_writes(sampler_nodes)  # recordings are written in the background; these tests read the bank at once
    return output.args[0]["samples"], output.ui["chorus_report"][0], summary, bank


def flush_writes(sampler_nodes):
    package = sampler_nodes.__name__.rpartition(".nodes.")[0]
    assert sys.modules[f"{package}.chorus_core.reuse.bank_writer"].flush_all(timeout=60)


def test_bank_loader_refuses_path_like_names(pack):
    loader, new = pack[0].ChorusMaskBankLoader, pack[0].NEW_BANK
    assert "plain folder name" in loader.validate_inputs(new, "../escape", False)
    assert loader.validate_inputs(new, "bad\x00", False).startswith("Chorus Mask Bank Loader:")
    assert loader.validate_inputs(new, "fresh", False) is True
    assert "is not an existing bank" in loader.validate_inputs("../escape", "fresh", False)
    with pytest.raises(ValueError, match="plain folder name"):
        loader.execute(new, "../escape", False)


def test_bank_loader_cache_key_follows_the_bank_content(pack, tiny_wan_patcher):
    bank_nodes = pack[0]
    before = bank_nodes.ChorusMaskBankLoader.fingerprint_inputs(bank_nodes.NEW_BANK, "keyed", False)
    generate(pack, tiny_wan_patcher, "keyed")
    after = bank_nodes.ChorusMaskBankLoader.fingerprint_inputs(bank_nodes.NEW_BANK, "keyed", False)
    assert before != after
    assert after == bank_nodes.ChorusMaskBankLoader.fingerprint_inputs(bank_nodes.NEW_BANK, "keyed", False)


def test_miss_records_then_similar_request_hits(pack, tiny_wan_patcher):
    _, first, summary, _ = generate(pack, tiny_wan_patcher, "flow", subject=0, seed=1)
    assert first["mode"] == "miss" and first["recorded_entry_id"]
    assert summary.startswith("Chorus: MISS")
    latent, second, summary, _ = generate(pack, tiny_wan_patcher, "flow", subject=2, seed=2)
    assert second["mode"] == "hit" and second["entry_id"] == first["recorded_entry_id"]
    assert summary.startswith(f"Chorus: HIT {first['recorded_entry_id']}")
    assert torch.isfinite(latent).all()


def test_corrupt_entry_is_reported_and_the_generation_falls_back(pack, tiny_wan_patcher):
    _, first, _, bank = generate(pack, tiny_wan_patcher, "corrupt", seed=1)
    blob = bank.blob_path(bank.show(first["recorded_entry_id"])["blob_name"])
    blob.write_bytes(blob.read_bytes()[:100])  # truncated, as a crashed copy would leave it
    latent, report, _, _ = generate(pack, tiny_wan_patcher, "corrupt", subject=1, seed=2)
    assert report["mode"] == "miss"
    assert any("skipped" in w for w in report["warnings"]), report["warnings"]
    assert torch.isfinite(latent).all()


def test_read_only_bank_matches_but_never_records(pack, tiny_wan_patcher):
    bank_nodes, sampler_nodes, testbed, _ = pack
    generate(pack, tiny_wan_patcher, "shared", seed=1)
    positive, negative, latent, clip, start = request_outputs(testbed, "orbit", 3, 5)
    (bank,) = bank_nodes.ChorusMaskBankLoader.execute("shared", "", True).args
    match, _ = bank_nodes.ChorusSimilarityMatch.execute(bank, tiny_wan_patcher, positive, latent, 0.9, 0.5, 0.3,
                                                        0.2, 32, start_latent=start, clip_vision_output=clip).args
    output = sampler_nodes.ChorusSparseWanSampler.execute(
        tiny_wan_patcher, positive, negative, latent, 0, 3, 5.0, "euler", "simple", 1.0, 1, "", "online", 0.9, 0.1,
        0.6, True, "", match=match)
    report = output.ui["chorus_report"][0]
    assert report["mode"] == "miss" and report["recorded_entry_id"] is None
    assert bank.stats()["entries"] == 1


def test_dense_attention_input_reaches_the_run_and_its_report(pack, tiny_wan_patcher):
    """Optional and last: the call without it (as saved workflows make it) is the "auto" default;
    on the CPU "auto" still runs ComfyUI's function, and the report says why."""
    _, sampler_nodes, testbed, _ = pack
    positive, negative, latent, _, _ = request_outputs(testbed, "pan", 0, 0)
    args = (tiny_wan_patcher, positive, negative, latent, 0, 2, 5.0, "euler", "simple", 1.0, 1, "", "dense", 0.9, 0.1,
            0.6, False, "")
    auto = sampler_nodes.ChorusSparseWanSampler.execute(*args).ui["chorus_report"][0]
    chosen = sampler_nodes.ChorusSparseWanSampler.execute(*args, dense_attention="comfyui").ui["chorus_report"][0]
    assert auto["dense_backend"] == "comfyui (ComfyUI's attention function; inputs are on the CPU)"
    assert chosen["dense_backend"] == "comfyui (ComfyUI's attention function; dense_attention='comfyui' was chosen)"
    with pytest.raises(ValueError, match="dense_attention 'fa4' is not one of auto, comfyui"):
        sampler_nodes.reuse_options(1, "", "online", 0.9, 0.1, 0.6, True, "", dense_attention="fa4")


def test_dense_layers_widget_rejects_garbage(pack):
    with pytest.raises(ValueError, match="comma-separated block indices"):
        sys.modules[pack[1].__name__.replace("sampler_nodes", "reuse_common")].parse_dense_layers("first, last")


def test_a_bank_that_cannot_store_the_recording_keeps_the_generation(pack, tiny_wan_patcher):
    import shutil

    bank_nodes, sampler_nodes, testbed, _ = pack
    positive, negative, latent, clip, start = request_outputs(testbed)
    (bank,) = bank_nodes.ChorusMaskBankLoader.execute(bank_nodes.NEW_BANK, "unwritable", False).args
    match, _ = bank_nodes.ChorusSimilarityMatch.execute(bank, tiny_wan_patcher, positive, latent, 0.9, 0.5, 0.3,
                                                        0.2, 32, start_latent=start, clip_vision_output=clip).args
    shutil.rmtree(bank.root / "blobs", ignore_errors=True)
    (bank.root / "blobs").write_text("not a folder")  # the disk goes bad while the run samples
    output = sampler_nodes.ChorusSparseWanSampler.execute(
        tiny_wan_patcher, positive, negative, latent, 0, 3, 5.0, "euler", "simple", 1.0, 1, "", "online", 0.9, 0.1,
        0.6, True, "", match=match)
    report = output.ui["chorus_report"][0]
    assert report["mode"] == "miss" and report["recording"] == "queued"  # written in the background
    flush_writes(sampler_nodes)
    writer = sys.modules[f"{sampler_nodes.__name__.rpartition('.nodes.')[0]}.chorus_core.reuse.bank_writer"]
    outcome = writer.default_writer().outcome(report["recorded_entry_id"])
    # the failed write is known to the writer, which tries it again later from the spool
    assert outcome.error and (outcome.done.is_set() or outcome.next_try is not None)
    assert bank.stats()["entries"] == 0
    assert torch.isfinite(output.args[0]["samples"]).all()


def test_similarity_match_refuses_a_non_power_of_two_block_size(pack):
    message = pack[0].ChorusSimilarityMatch.validate_inputs(block_size=48)
    assert "power of two" in message
    assert pack[0].ChorusSimilarityMatch.validate_inputs(block_size=64) is True


def test_sampler_validates_density_bounds(pack):
    sampler = pack[1].ChorusSparseWanSampler
    assert "must not exceed" in sampler.validate_inputs(min_density=0.6, max_density=0.5)
    assert sampler.validate_inputs(min_density=0.1, max_density=0.5) is True

def test_prior_miss_mode_uses_the_banks_population_prior(pack, tiny_wan_patcher):
    bank_nodes, sampler_nodes, testbed, _ = pack
    _, first, _, bank = generate(pack, tiny_wan_patcher, "prior", seed=1)
    hits_before = bank.show(first["recorded_entry_id"])["hits"]
    positive, negative, latent, clip, start = request_outputs(testbed, "orbit", 3, 5)
    match, _ = bank_nodes.ChorusSimilarityMatch.execute(bank, tiny_wan_patcher, positive, latent, 0.9, 0.5, 0.3,
                                                        0.2, 32, start_latent=start, clip_vision_output=clip).args
    output = sampler_nodes.ChorusSparseWanSampler.execute(
        tiny_wan_patcher, positive, negative, latent, 0, 3, 5.0, "euler", "simple", 1.0, 1, "", "prior", 0.9, 0.1,
        0.6, False, "", match=match)
    report = output.ui["chorus_report"][0]
    assert report["mode"] == "miss"
    assert report["mask_source"] == "population prior of 1 entries"
    # 3 steps at the node's defaults: the miss's dense warm-up, one sparse step, the dense last step
    assert [layer["sparse_share"] for layer in report["layers"]] == [1 / 3, 1 / 3]
    assert bank.show(first["recorded_entry_id"])["hits"] == hits_before  # reading a prior is not a hit


def test_prior_miss_mode_predicts_online_when_the_bank_is_empty(pack, tiny_wan_patcher):
    bank_nodes, sampler_nodes, testbed, _ = pack
    positive, negative, latent, clip, start = request_outputs(testbed)
    (bank,) = bank_nodes.ChorusMaskBankLoader.execute(bank_nodes.NEW_BANK, "empty_prior", False).args
    match, _ = bank_nodes.ChorusSimilarityMatch.execute(bank, tiny_wan_patcher, positive, latent, 0.9, 0.5, 0.3,
                                                        0.2, 32, start_latent=start, clip_vision_output=clip).args
    output = sampler_nodes.ChorusSparseWanSampler.execute(
        tiny_wan_patcher, positive, negative, latent, 0, 3, 5.0, "euler", "simple", 1.0, 1, "", "prior", 0.9, 0.1,
        0.6, False, "", match=match)
    assert output.ui["chorus_report"][0]["mask_source"] == "online prediction"


def test_a_cancelled_hit_releases_its_prefetched_entry(pack, tiny_wan_patcher):
    """Cancel during sampling (ComfyUI's progress hook raises, as its server does on Cancel):
    the prefetch worker is joined and its host buffers (pinned on a GPU) dropped at once, not
    whenever the garbage collector gets to the traceback that still holds the run."""
    import comfy.model_management
    import comfy.utils

    bank_nodes, sampler_nodes, testbed, _ = pack
    _, first, _, bank = generate(pack, tiny_wan_patcher, "cancelled", seed=1)
    positive, negative, latent, clip, start = request_outputs(testbed, "pan", 2)
    match, summary = bank_nodes.ChorusSimilarityMatch.execute(bank, tiny_wan_patcher, positive, latent, 0.9, 0.5,
                                                              0.3, 0.2, 32, start_latent=start,
                                                              clip_vision_output=clip).args
    assert summary.startswith("Chorus: HIT")

    def cancel(value, total, preview, **_):
        if value >= 2:  # after the first sparse step: the entry is loaded and decoded
            comfy.model_management.interrupt_current_processing(True)
            comfy.model_management.throw_exception_if_processing_interrupted()

    comfy.utils.set_progress_bar_global_hook(cancel)
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException) as info:
            sampler_nodes.ChorusSparseWanSampler.execute(
                tiny_wan_patcher, positive, negative, latent, 0, 3, 5.0, "euler", "simple", 1.0, 1, "", "online",
                0.9, 0.1, 0.6, False, "", match=match)
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
    patches = [frame.f_locals["patch"] for frame, _ in traceback.walk_tb(info.value.__traceback__)
               if frame.f_code.co_name == "execute" and "patch" in frame.f_locals]
    run = patches[0].last_run if len(patches) == 1 else None  # the run the traceback keeps alive
    assert run is not None and run.prefetch is not None
    prefetch = run.prefetch
    assert not prefetch._thread.is_alive() and prefetch._host == {} and prefetch._entry is None


def test_a_received_bank_with_priors_linked_to_the_models_keeps_them_and_the_generation(pack, tiny_wan_patcher,
                                                                                        tmp_path):
    """priors/ -> a folder of checkpoints: the prior-mode miss (and its recording) run, and no
    file there is written or removed."""
    bank_nodes, sampler_nodes, testbed, banks = pack
    _, first, _, bank = generate(pack, tiny_wan_patcher, "linked_priors", seed=1)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "wan2.1_i2v_14b.safetensors").write_bytes(b"weights")
    (bank.root / "priors").symlink_to(checkpoints)
    positive, negative, latent, clip, start = request_outputs(testbed, "orbit", 3, 5)
    match, _ = bank_nodes.ChorusSimilarityMatch.execute(bank, tiny_wan_patcher, positive, latent, 0.9, 0.5, 0.3,
                                                        0.2, 32, start_latent=start, clip_vision_output=clip).args
    with pytest.warns(UserWarning, match="priors is a symbolic link"):
        output = sampler_nodes.ChorusSparseWanSampler.execute(
            tiny_wan_patcher, positive, negative, latent, 0, 3, 5.0, "euler", "simple", 1.0, 1, "", "prior", 0.9,
            0.1, 0.6, True, "", match=match)
        flush_writes(sampler_nodes)  # the recording refreshes the prior too
    report = output.ui["chorus_report"][0]
    assert (report["mode"], report["mask_source"], report["recording"]) == (
        "miss", "population prior of 1 entries", "queued")
    assert bank.stats()["entries"] == 2
    assert [(p.name, p.read_bytes()) for p in checkpoints.iterdir()] == [("wan2.1_i2v_14b.safetensors", b"weights")]


def test_a_signal_comfyui_was_started_to_ignore_stays_ignored(pack):
    """``nohup`` or a background job starts ComfyUI with SIGINT ignored: the drain leaves it so (it would
    otherwise drain and go on running, swallowing the signal), and still takes SIGTERM."""
    import signal
    from importlib import import_module

    lifecycle = import_module(pack[0].__name__.rsplit(".nodes.", 1)[0] + ".nodes.spool_lifecycle")
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        lifecycle.install_signal_drain()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert getattr(signal.getsignal(signal.SIGTERM), "chorus_drain", False)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_the_loader_keeps_one_bank_object_whose_index_grows_with_each_write(pack, tiny_wan_patcher):
    """ComfyUI's cache key changes with every write; the bank object (and its signature index,
    which otherwise every worker read again in full) must not."""
    _, first, _, bank = generate(pack, tiny_wan_patcher, "kept", subject=0, seed=1)
    _, other, _, same = generate(pack, tiny_wan_patcher, "kept", template="orbit", subject=3, layout=5, seed=3)
    assert same is bank and other["recorded_entry_id"] != first["recorded_entry_id"]
    _, hit, _, again = generate(pack, tiny_wan_patcher, "kept", template="orbit", subject=1, layout=5, seed=4)
    assert again is bank and hit["mode"] == "hit" and hit["entry_id"] == other["recorded_entry_id"]


def test_a_bank_deleted_and_made_again_gets_a_new_object(pack, tiny_wan_patcher):
    import shutil

    bank_nodes, _, _, banks = pack
    _, first, _, bank = generate(pack, tiny_wan_patcher, "remade", subject=0, seed=1)
    shutil.rmtree(banks / "remade")
    _, again, _, fresh = generate(pack, tiny_wan_patcher, "remade", subject=2, seed=2)
    assert fresh is not bank
    assert again["mode"] == "miss" and fresh.stats()["entries"] == 1  # the new bank, not the deleted one
