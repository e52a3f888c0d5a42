"""The user-stack benchmark runs end to end at a tiny size on the CPU, :sage and :flash rows included."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.comfy
BENCH = REPO_ROOT / "tests" / "benchmarks" / "bench_user_stack.py"


def test_sage_rows_run_comfyuis_sage_attention_and_chorus_leaves_it_the_dense_calls(tmp_path, comfyui_path):
    rows = "bf16:dense:eager,bf16:dense:eager:sage,bf16:miss:eager,bf16:hit:eager:sage,bf16:hit:eager,bf16:hit_last1:eager,"
    rows += "bf16:hit_fp8:eager,bf16:hit_int8:eager,bf16:dense:eager:flash,bf16:dense:eager:torch,bf16:dense:eager:fa4"
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path, "--weights-dir", tmp_path / "w",
                           "--bank", tmp_path / "bank", "--rows", rows], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = {r["name"]: r for r in json.loads((tmp_path / "user_stack_tiny.json").read_text())["rows"]}
    # only the file these rows load was written (a 14B file costs the device call a minute)
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["wan_tiny_bf16.safetensors"]
    assert result["bf16_dense_eager"]["attention"] == "cudnn_sdpa"
    assert result["bf16_dense_eager_sage"]["attention"] == "sageattention_1.0.6"
    assert result["bf16_dense_eager_sage"]["role"] == "dense"  # a dense baseline like the others
    flash = result["bf16_dense_eager_flash"]  # torch SDPA's flash kernel first: on the CPU, the order is not set
    assert (flash["attention"], flash["role"]) == ("flash_sdpa", "dense")
    linux_default = result["bf16_dense_eager_torch"]  # torch's own order, as ComfyUI leaves it on Linux
    assert (linux_default["attention"], linux_default["role"]) == ("torch_sdpa_default_order", "dense")
    fa4 = result["bf16_dense_eager_fa4"]  # FA4's dense forward in ComfyUI's place; on the CPU its reference
    assert (fa4["attention"], fa4["role"]) == ("fa4_dense", "dense")
    # ComfyUI's attention_sage ran (on CPU tensors it falls back to torch, and says so)
    assert "Error running sage attention" in done.stdout + done.stderr
    assert "SageAttention" in result["bf16_hit_eager_sage"]["dense_backend"]
    assert "SageAttention" not in (result["bf16_hit_eager"]["dense_backend"] or "")  # put back after the row
    assert result["bf16_hit_eager_sage"]["run_mode"] == "hit"
    # the hit is sparse from the first step; hit_last1 keeps its last step dense, and is a hit row
    assert result["bf16_hit_eager"]["dense_steps"] == 0
    last1 = result["bf16_hit_last1_eager"]
    assert (last1["run_mode"], last1["role"], last1["dense_steps"]) == ("hit", "hit", 1)
    # attention_precision "fp8": on CPU tensors the FP8 scheme's reference runs, and the row says so
    fp8 = result["bf16_hit_fp8_eager"]
    assert (fp8["run_mode"], fp8["role"]) == ("hit", "hit")
    assert fp8["backend"].startswith("reference_fp8") and fp8["attention"].startswith("chorus_block_sparse_fp8")
    assert fp8["report_timings"]  # the run report's timings travel with the row (the first step's profile)
    int8 = result["bf16_hit_int8_eager"]  # "int8": QK^T alone quantised, its own reference on the CPU
    assert int8["backend"].startswith("reference_int8") and int8["attention"].startswith("chorus_block_sparse_int8")

    # a later call at another step count finds no entry of its own in the kept bank: the call stops
    # before anything is set up, with what to run first (the 4-step entry would not serve it)
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path / "later", "--weights-dir",
                           tmp_path / "w", "--bank", tmp_path / "bank", "--steps", "8", "--rows", "bf16:hit:eager"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    assert done.returncode != 0 and "bf16:hit:eager: no entry recorded for tiny at 8 steps" in done.stderr, \
        done.stderr[-2000:]
    assert not (tmp_path / "later").exists()

    # no cfg in what an entry serves (the bank matches none): a cfg-5 hit on the cfg-1 recording,
    # and the row says which cfg recorded its entry
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path / "cfg5", "--weights-dir",
                           tmp_path / "w", "--bank", tmp_path / "bank", "--cfg", "5", "--rows", "bf16:hit:eager"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (cfg5,) = json.loads((tmp_path / "cfg5" / "user_stack_tiny.json").read_text())["rows"]
    assert (cfg5["run_mode"], cfg5["cfg"], cfg5["entry_recorded_cfg"]) == ("hit", 5.0, 1.0)
    assert "entry_recorded_cfg" not in result["bf16_dense_eager"]


def test_a_row_names_only_known_attentions_and_a_bad_one_stops_the_call_at_once(tmp_path):
    """In a process of its own: the benchmark puts the repository first on sys.path, where its
    nodes/ package would stand in for ComfyUI's nodes module in every later test."""
    for bad in ("bf16:hit:compiled:xformers", "bf16:hit:compiled:sage:x", "bf16:dense"):
        done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path, "--weights-dir",
                               tmp_path / "never", "--rows", f"bf16:dense:eager,{bad}"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and f"bad row {bad!r}" in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "never").exists()  # nothing was built before the rows were checked


def test_core_rows_send_self_attention_to_comfy_kitchens_sol_attn_as_cores_node_does(tmp_path, comfyui_path):
    """On the CPU the rows run comfy-kitchen's eager sol_attn (the GPU runs its CUDA kernel): every
    self-attention call past the node's start goes there, cross-attention stays ComfyUI's."""
    pytest.importorskip("comfy_kitchen")
    rows = "bf16:dense:eager,bf16:core:eager,bf16:core_topk:eager"
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path, "--weights-dir", tmp_path / "w",
                           "--bank", tmp_path / "bank", "--rows", rows], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "user_stack_tiny.json").read_text())
    assert not doc["details"]["errors"], doc["details"]["errors"]
    result = {r["name"]: r for r in doc["rows"]}
    defaults, topk = result["bf16_core_eager"], result["bf16_core_topk_eager"]
    assert defaults["role"] == topk["role"] == "peer"
    assert defaults["attention"].startswith("core_sol_attn (tau 1.3, start 0.2, extra_tokens 256")
    assert topk["attention"].startswith("core_sol_attn (topk 0.15, start 0, extra_tokens 256")
    blocks, steps = 2, 4
    # top-k from the first step: each of 4 steps' 2 self-attention calls is sparse
    assert topk["sparse_calls"] == blocks * steps
    # defaults: dense while sigma is above percent_to_sigma(0.2) (the first of 4 steps here)
    assert defaults["sparse_calls"] == blocks * (steps - 1)
    # the node asks about sigma first: in that step the self and both cross-attentions (text, image)
    # are dense for that reason; later, the cross-attentions for theirs
    assert defaults["dense_calls"] == {"sigma outside start/end": blocks * 3, "cross-attention": blocks * (steps - 1) * 2}
    assert 0 < defaults["routed_share"] <= 1 and topk["routed_share"] == 0.15
    assert defaults["vs_core_same_weights"] == 1.0 and result["bf16_dense_eager"]["vs_core_same_weights"]


def test_a_cold_baseline_is_counted_warm_so_no_ratio_is_flattered_by_it():
    """The first generation after a load moves the weights and meets every kernel first: its first
    step counts at the median of its others, and ratios divide by that (in a process of its own)."""
    code = """
import json, sys
sys.argv = ['x']
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
base = dict(session='s', shape='640x640', steps=4, cfg=1.0, weights='fp8_e4m3fn_fast', arm='dense', role='dense')
rows = [dict(base, name='cold', seconds=15.0, model_load_s=2.5, step_ms=[6000.0, 3000.0, 3000.0, 3000.0]),
        dict(base, name='hit', arm='hit', role='hit', seconds=6.0, model_load_s=0.01, step_ms=[1500.0] * 4),
        dict(base, name='miss', arm='miss', role='miss', seconds=12.0, model_load_s=2.0,
             step_ms=[6000.0, 2000.0, 2000.0, 2000.0])]
b.ratios(rows)
print(json.dumps([(r['warm_seconds'], r['vs_dense_same_weights']) for r in rows]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (cold_warm, cold_ratio), (hit_warm, hit_ratio), (miss_warm, _) = json.loads(done.stdout.strip().splitlines()[-1])
    assert cold_warm == 12.0 and hit_warm is None  # 15 s less the first step's 3 s over the median
    assert hit_ratio == 2.0 and cold_ratio == 0.8  # 12 / 6, not 15 / 6; the cold run itself 12 / 15
    # a cold miss's first step is its dense one: only the weights' move (2 s) comes off, not 4 s
    assert miss_warm == 10.0


def test_fp8_attention_hits_on_the_fp8_loads_users_run(tmp_path, comfyui_path):
    """attention_precision "fp8" on an fp8_scaled file and on UNETLoader's fp8_e4m3fn_fast weights:
    each miss records an entry of its own model and the FP8 hit serves it (on the CPU the FP8
    scheme's reference computes the block-sparse calls)."""
    rows = ("fp8_scaled:miss:eager,fp8_scaled:hit_fp8:eager,"
            "fp8_e4m3fn_fast:miss:eager,fp8_e4m3fn_fast:hit_last1_fp8:eager")
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path, "--weights-dir", tmp_path / "w",
                           "--bank", tmp_path / "bank", "--rows", rows], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "user_stack_tiny.json").read_text())
    assert doc["details"]["errors"] == []
    result = {r["name"]: r for r in doc["rows"]}
    for weights, arm in (("fp8_scaled", "hit_fp8"), ("fp8_e4m3fn_fast", "hit_last1_fp8")):
        hit = result[f"{weights}_{arm}_eager"]
        assert hit["run_mode"] == "hit" and hit["backend"].startswith("reference_fp8"), hit
        assert hit["entry_id"] == result[f"{weights}_miss_eager"]["recorded_entry_id"]
    assert result["fp8_e4m3fn_fast_hit_last1_fp8_eager"]["dense_steps"] == 1


def test_flash_rows_put_torchs_flash_kernel_first_where_the_others_put_cudnn(tmp_path):
    """What a :flash row asks torch for on a GPU: flash first in SDPA's priority order, cuDNN after
    it only for shapes flash refuses (the CPU has no order to set, so sdpa_kernel is recorded here)."""
    probe = (
        "import sys, torch.nn.attention as a\n"
        f"sys.path.insert(0, {str(BENCH.parent)!r})\n"
        "import bench_user_stack as b\n"
        "seen = []\n"
        "a.sdpa_kernel = lambda backends, set_priority: (seen.append(([x.name for x in backends], set_priority)),"
        " __import__('contextlib').nullcontext())[1]\n"
        "for order in (b.SDPA_ORDER, b.FLASH_SDPA_ORDER):\n"
        "    with b.sdpa_priority(True, order):\n"
        "        pass\n"
        "print(seen)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str([
        (["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"], True),
        (["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"], True)])


def test_a_dense_row_longer_than_a_call_runs_in_stages_and_the_merge_joins_them(tmp_path, comfyui_path):
    """--stage: 720p at 40 steps, cfg 5 (a dense run of about 870 s) does not fit a 600 s device
    call, so its dense rows run as two stages, one call each, and --merge joins each row's stages;
    a Chorus row runs whole, and a later stage without its first one is refused before any set-up."""
    env = {**os.environ, "COMFYUI_PATH": str(comfyui_path)}

    def call(tag: str, *extra) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path / tag, "--tag", tag,
                               "--weights-dir", tmp_path / "w", "--bank", tmp_path / "bank", "--stage-latent",
                               tmp_path / "latents", *map(str, extra)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)

    chorus = call("x", "--stage", "0:2", "--rows", "bf16:dense:eager,bf16:miss:eager")
    assert chorus.returncode != 0 and "bf16:miss:eager is a Chorus row" in chorus.stderr
    short = call("x", "--warmup-steps", "2", "--rows", "bf16:hit_last1:compiled")  # its last step: a graph of its own
    assert short.returncode != 0 and "--warmup-steps: bf16:hit_last1:compiled needs its whole schedule" in short.stderr
    one = call("x", "--warmup-steps", "1", "--rows", "bf16:dense:compiled")  # dynamo compiles again on call two
    assert one.returncode != 0 and "give --warmup-steps 2 or more" in one.stderr
    early = call("early", "--stage", "2:4", "--rows", "bf16:dense:eager")
    assert early.returncode != 0 and "run --stage 0:2 of bf16_dense_eager first" in early.stderr
    assert not (tmp_path / "w").exists()  # refused before the checkpoint files were built
    for tag, stage in (("s1", "0:2"), ("s2", "2:4")):
        done = call(tag, "--stage", stage, "--rows", "bf16:dense:eager")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # a compiled stage compiles on a short whole schedule first (a 20-step warm-up at 720p, cfg 5
    # would take a call's time): its timed run is the stage, and its latent is what the next starts from
    compiled = call("c1", "--stage", "0:2", "--warmup-steps", "2", "--rows", "bf16:dense:compiled")
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    assert re.search(r"bf16:dense:compiled: warm-up \(compile\) [0-9.]+ s, steps \[[0-9.]+, [0-9.]+\],", compiled.stdout
                     + compiled.stderr)
    [warm] = json.loads((tmp_path / "c1" / "user_stack_tiny_c1.json").read_text())["rows"]
    assert warm["stage"] == [0, 2] and len(warm["step_ms"]) == 2 and warm["compile_s"] > 0
    parts = [json.loads((tmp_path / t / f"user_stack_tiny_{t}.json").read_text())["rows"][0] for t in ("s1", "s2")]
    assert [p["stage"] for p in parts] == [[0, 2], [2, 4]] and [len(p["step_ms"]) for p in parts] == [2, 2]
    assert all(p["vs_dense_same_weights"] is None for p in parts)  # a stage alone is no generation

    def merge(*tags) -> dict:
        out = tmp_path / ("m_" + "_".join(tags))
        done = subprocess.run([sys.executable, str(BENCH), "--merge",
                               ",".join(str(tmp_path / t / f"user_stack_tiny_{t}.json") for t in tags),
                               "--out", out], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((out / "user_stack_tiny.json").read_text())

    half = merge("s1")  # the second stage not yet timed: no row, and a note that says why
    assert half["rows"] == [] and any("stop at step 2 of 4" in n for n in half["details"]["notes"])
    [row] = merge("s1", "s2")["rows"]
    assert row["seconds"] == round(parts[0]["seconds"] + parts[1]["seconds"], 3) and len(row["step_ms"]) == 4
    assert [s["stage"] for s in row["stages"]] == [[0, 2], [2, 4]] and row["stage"] is None
    assert row["run"] == f"{parts[0]['run']}+{parts[1]['run']}" and row["vs_dense_same_weights"] is not None
    assert merge("s2", "s1")["rows"] == [row]  # the files' order does not matter: stages join in step order
    # each stage's first step counts at the median of the other steps, as a cold first generation's does
    firsts, rest = [row["step_ms"][0], row["step_ms"][2]], [row["step_ms"][1], row["step_ms"][3]]
    median = sum(rest) / 2
    assert row["warm_seconds"] == round(row["seconds"] - sum(max(0.0, f - median) for f in firsts) / 1e3, 3)


def test_stages_from_two_machines_join_without_ratios_and_one_step_stages_have_no_warm_count():
    """A row joined from stages that ran on two machine sessions compares with nothing (ratios stay
    within one machine) and the merge says so; stages of one step each leave no other step to count
    their first steps at, so the joined row has no warm_seconds (in a process of its own)."""
    code = """
import json, sys
sys.argv = ['x']
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
base = dict(name='d', steps=2, cfg=5.0, shape='720p', weights='fp8_e4m3fn_fast', arm='dense', role='dense', graphs=0)
rows = [dict(base, stage=[1, 2], seconds=3.0, step_ms=[3000.0], session='B', run='B-2'),
        dict(base, stage=[0, 1], seconds=2.0, step_ms=[2000.0], session='A', run='A-1')]
notes = []
whole, kept = b.join_staged_rows(rows, notes)
b.ratios(whole)
print(json.dumps([whole, len(kept), notes]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    [row], kept, notes = json.loads(done.stdout.strip().splitlines()[-1])
    assert (row["seconds"], row["session"], row["run"], row["step_ms"]) == (5.0, "A+B", "A-1+B-2", [2000.0, 3000.0])
    assert row["warm_seconds"] is None and row["vs_dense_same_weights"] == 1.0 and kept == 2
    assert notes == ["d at 2 steps: its stages ran on machine sessions A, B, so its row has no ratios to other "
                     "rows, nor they to it (ratios stay within one machine)"]


def test_a_merged_files_header_names_every_schedule_its_rows_ran_and_each_row_its_own(tmp_path):
    """A merged file holds 4-step, cfg 1 and 40-step rows: its header names both schedules, and
    each row of the table says its steps and cfg (in a process of its own)."""
    code = f"""
import sys
from pathlib import Path
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
base = dict(shape='720p', weights='w', arm='dense', role='dense', attention='cudnn_sdpa', graphs=0, session='A',
            stage=None, step_ms=[1.0])
rows = [dict(base, name='d40', steps=40, cfg=1.0, seconds=40.0, run='A-2'),
        dict(base, name='d4', steps=4, cfg=1.0, seconds=4.0, run='A-1')]
details = dict(steps=4, cfg=1.0, torch='t', comfyui='c', comfy_kitchen='k', shape='720p', tokens=1, blocks=2,
               density=0.15, models={{}}, notes=[], errors=[])
doc = dict(machine='m', date='d', command='x', git_commit='g', method='', details=details, rows=rows)
b.write_results(Path({str(tmp_path)!r}), 'user_stack_720p', doc)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (tmp_path / "user_stack_720p.md").read_text().splitlines()
    assert any(line.endswith("2 blocks, 4 steps, cfg 1.0; 40 steps, cfg 1.0, density 0.15") for line in lines)
    header, *table = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    rows = {cells[0]: dict(zip(header, cells)) for cells in table}
    assert [rows["d4"]["steps"], rows["d40"]["steps"], rows["d40"]["cfg"]] == ["4", "40", "1.0"]


def test_a_merge_of_two_cards_names_both_and_each_row_keeps_its_own(tmp_path):
    """Calls on an H100 and on an H200 merged into one file: its header names both cards, each row
    (and each stage kept apart) says which card ran it, and no ratio crosses the two (in a process
    of its own)."""
    code = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
tmp = Path({str(tmp_path)!r})
def doc(machine, session, seconds, role):
    row = dict(name=role, shape='720p', weights='fp8_e4m3fn_fast', arm=role, role=role, attention='a', graphs=0,
               session=session, run=session + '-1', stage=None, step_ms=[1.0], steps=40, cfg=5.0, seconds=seconds)
    details = dict(steps=40, cfg=5.0, torch='t', comfyui='c', comfy_kitchen='k', shape='720p', tokens=1, blocks=2,
                   density=0.15, models={{}}, notes=[], errors=[], weights_files=[])
    return dict(machine=machine, date=session, command='x', git_commit='g', method='', details=details, rows=[row])
for machine, session, seconds, role in (('H100 card', 'A', 10.0, 'dense'), ('H200 card', 'B', 4.0, 'hit')):
    (tmp / session).mkdir()
    (tmp / session / 'f.json').write_text(json.dumps(doc(machine, session, seconds, role)))
b.merge([tmp / 'A' / 'f.json', tmp / 'B' / 'f.json'], tmp / 'm', 'merge', [], [])
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    merged = json.loads((tmp_path / "m" / "user_stack_720p.json").read_text())
    assert merged["machine"] == "H100 card and H200 card"
    assert [(r["name"], r["machine"]) for r in merged["rows"]] == [("dense", "H100 card"), ("hit", "H200 card")]
    assert merged["rows"][1]["vs_fastest_dense_fp8"] is None  # the dense row ran on the other card
    assert (tmp_path / "m" / "user_stack_720p.md").read_text().startswith(
        "# The user's stack: whole generations (H100 card and H200 card)")


def test_dynamic_vram_is_refused_with_its_reason_before_any_weights_are_written(tmp_path, comfyui_path):
    """--dynamic-vram on a machine that cannot run it (here: no GPU; on 0.3.64: no DynamicVRAM at all)
    stops the call with the reason before a checkpoint is written (14B files cost a device call a minute)."""
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--dynamic-vram", "--out", tmp_path, "--weights-dir",
                           tmp_path / "w", "--bank", tmp_path / "bank", "--rows", "bf16:dense:eager"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    reasons = ("DynamicVRAM needs an NVIDIA GPU; ComfyUI runs on cpu",  # 0.19.3: comfy-aimdo installed
               "this ComfyUI has no DynamicVRAM (it came with 0.19): leave it off")  # 0.3.64
    assert done.returncode != 0 and any(f"--dynamic-vram: {r}" in done.stderr for r in reasons), done.stderr[-2000:]
    assert not (tmp_path / "w").exists() and not (tmp_path / "user_stack_tiny.json").exists()


def test_rows_of_two_memory_managers_compare_only_with_their_own():
    """DynamicVRAM rows and a legacy dense row of one machine session: no ratio crosses them (each
    manager's rows against their own dense row, counted warm); rows kept from before ``memory`` was
    recorded are legacy (in a process of its own)."""
    code = """
import json, sys
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
base = dict(shape='720p', weights='fp8_e4m3fn_fast', graphs=0, session='A', run='A-1', stage=None, step_ms=[1.0],
            steps=4, cfg=1.0)
dyn = dict(base, memory='dynamic_vram', run='A-2', model_load_s=0.08)
rows = [dict(base, name='dense', arm='dense', role='dense', seconds=40.0),
        dict(dyn, name='dense_dynamic_vram', arm='dense', role='dense', seconds=44.0, step_ms=[20e3, 8e3, 8e3, 8e3]),
        dict(dyn, name='miss_dynamic_vram', arm='miss', role='miss', seconds=32.0, step_ms=[14e3, 6e3, 6e3, 6e3]),
        dict(dyn, name='hit_dynamic_vram', arm='hit', role='hit', seconds=9.0, step_ms=[2.25e3] * 4),
        dict(dyn, name='bf16_dynamic_vram', weights='bf16', arm='dense', role='dense', seconds=50.0,
             step_ms=[20e3, 10e3, 10e3, 10e3])]
b.ratios(rows)
print(json.dumps({r['name']: [r['warm_seconds'], r['vs_dense_same_weights']] for r in rows}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # DynamicVRAM moves the weights inside the first step (model_load_s near 0): each model's first row
    # of the run counts warm, the first step at the median of the others; a miss's dense first step stays
    # (a cold row against its own warm count is under 1.0x)
    assert got == {"dense": [None, 1.0], "dense_dynamic_vram": [32.0, 0.727], "miss_dynamic_vram": [None, 1.0],
                   "hit_dynamic_vram": [None, 3.556], "bf16_dynamic_vram": [40.0, 0.8]}


def test_a_compiled_baseline_whose_timed_run_still_compiled_counts_those_steps_warm():
    """A warm-up too short to meet every graph leaves a compile in the timed run (its ``graphs``):
    that many of its slowest steps count at the median of the others, so no ratio is flattered by
    the compile; a row that compiled nothing keeps its seconds (in a process of its own)."""
    code = """
import json, sys
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
base = dict(session='s', shape='640x640', steps=4, cfg=5.0, weights='fp8_e4m3fn_fast', stage=None, model_load_s=0.01)
rows = [dict(base, name='fa4', arm='dense', role='dense', compiled=True, graphs=1, seconds=16.0,
             step_ms=[2000.0, 10000.0, 2000.0, 2000.0]),
        dict(base, name='hit', arm='hit', role='hit', compiled=True, graphs=0, seconds=4.0, step_ms=[1000.0] * 4)]
b.ratios(rows)
print(json.dumps([(r['warm_seconds'], r['vs_dense_same_weights']) for r in rows]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (dense_warm, dense_ratio), (hit_warm, hit_ratio) = json.loads(done.stdout.strip().splitlines()[-1])
    assert dense_warm == 8.0 and hit_warm is None  # the 10 s step at the 2 s median of the others
    assert hit_ratio == 2.0 and dense_ratio == 0.5  # 8 / 4, not 16 / 4


def test_each_session_whose_stages_cover_the_schedule_gets_a_row_of_its_own():
    """Two machines each timed a dense row in two stages: two rows, each within its session (its
    ratios stay there), not one row of the first file's stages; a third session's lone stage joins
    a fourth's across sessions, with the note that says so (in a process of its own)."""
    code = """
import json, sys
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
base = dict(name='bf16_dense_eager_torch', steps=4, cfg=5.0, shape='640x640', step_ms=[1000.0, 1000.0])
def stage(session, a, seconds):
    return dict(base, session=session, run=session + '-' + str(a), stage=[a, a + 2], seconds=seconds)
rows = [stage('A', 0, 2.0), stage('A', 2, 2.5), stage('B', 0, 3.0), stage('B', 2, 3.5), stage('C', 0, 4.0),
        stage('D', 2, 5.0)]
notes = []
whole, kept = b.join_staged_rows(rows, notes)
print(json.dumps([[r['session'], r['seconds']] for r in whole] + [len(kept), notes]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    *rows, kept, notes = json.loads(done.stdout.strip().splitlines()[-1])
    assert rows == [["A", 4.5], ["B", 6.5], ["C+D", 9.0]] and kept == 6
    assert notes == ["bf16_dense_eager_torch at 4 steps: its stages ran on machine sessions C, D, so its row has no "
                     "ratios to other rows, nor they to it (ratios stay within one machine)"]


def test_a_miss_that_recorded_nothing_serves_no_hit_and_a_hit_names_only_its_own_entrys_cfg():
    """A failed recording must not let a later hit row run as a miss (the refusal before the load
    exists for that); an older bank's bare id still serves; the cfg is named only for the entry
    this bench recorded (in a process of its own)."""
    code = """
import sys
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
ctx = dict(shape='720p', steps=40, recorded={})
ctx['recorded'][b.recorded_key(ctx, 'w')] = dict(entry=None, cfg=1.0)
assert b.recorded_entry(ctx, 'w') is None
ctx['recorded'][b.recorded_key(ctx, 'w')] = 'abc'
assert b.recorded_entry(ctx, 'w') == dict(entry='abc', cfg=None)
ctx['recorded'][b.recorded_key(ctx, 'w')] = dict(entry='abc', cfg=1.0)
assert b.entry_cfg(ctx, 'w', 'abc') == 1.0 and b.entry_cfg(ctx, 'w', 'other') is None
print('ok')
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stdout[-2000:] + done.stderr[-2000:]


def test_a_hit_no_entry_serves_stops_the_call_before_any_weights_are_written(tmp_path):
    """A hit row needs an entry for its weights at the call's shape and step count: recorded by an
    earlier call (the bank's store) or by a miss row of the same weights before it in this call.
    Without one the call stops at once, before weights are written (in a process of its own)."""
    def call(rows: str, steps: int = 4) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path / "out", "--weights-dir",
                               tmp_path / "never", "--bank", tmp_path / "bank", "--steps", str(steps), "--rows", rows],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)

    for rows in ("bf16:hit_fp8:eager", "bf16:hit:eager,bf16:miss:eager", "fp8_e4m3fn_fast:miss:eager,bf16:hit:eager"):
        done = call(rows)
        assert done.returncode != 0 and "no entry recorded for tiny at 4 steps" in done.stderr, done.stderr[-2000:]
        assert "run WEIGHTS:miss:eager first" in done.stderr
        assert not (tmp_path / "never").exists()  # refused before any weights were written
    (tmp_path / "bank").mkdir()
    four_steps = {"bf16@tiny@4steps": {"entry": "e1", "cfg": 1.0}}
    (tmp_path / "bank" / "user_stack_recorded.json").write_text(json.dumps(four_steps))
    done = call("bf16:hit:eager", steps=8)  # an entry for 4 steps serves no 8-step run
    assert done.returncode != 0 and "no entry recorded for tiny at 8 steps" in done.stderr, done.stderr[-2000:]
    built = subprocess.run([sys.executable, str(BENCH), "--tiny", "--build-only", "--weights-dir", tmp_path / "w",
                            "--bank", tmp_path / "empty", "--rows", "bf16:hit:eager"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0 and any((tmp_path / "w").iterdir()), built.stderr[-2000:]  # builds files, runs no row
    code = """
import sys
sys.path.insert(0, 'tests/benchmarks')
import bench_user_stack as b
store = {'bf16@tiny@4steps': {'entry': 'e1', 'cfg': 1.0}, 'fp8_e4m3fn_fast@tiny@4steps': {'entry': None, 'cfg': 1.0}}
assert b.hits_no_entry_serves(['bf16:hit:eager', 'bf16:hit_last1_fp8:compiled'], store, 'tiny', 4) == []
assert b.hits_no_entry_serves(['bf16:miss:eager', 'bf16:hit:eager'], {}, 'tiny', 4) == []
assert b.hits_no_entry_serves(['fp8_e4m3fn_fast:hit:eager', 'bf16:dense:eager'], store, 'tiny', 4) == ['fp8_e4m3fn_fast:hit:eager']
assert b.hits_no_entry_serves(['bf16:hit:eager'], {'bf16@tiny@4steps': 'e0'}, 'tiny', 4) == []
print('ok')
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stdout[-2000:] + done.stderr[-2000:]


def test_a_compiled_hits_warm_up_runs_its_own_schedule_stopped_early_and_the_timed_run_is_whole(tmp_path, comfyui_path):
    """--warmup-steps on a compiled hit: the warm-up samples the hit's own 4-step schedule (the
    entry serves that step count) and is stopped after 2 steps, its graphs compiled; the timed run
    that follows is the whole hit, which compiled nothing more; the same for an online miss, whose
    first step is dense (in a process of its own)."""
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path, "--weights-dir", tmp_path / "w",
                           "--bank", tmp_path / "bank", "--steps", "4", "--warmup-steps", "2",
                           "--rows", "bf16:miss:eager,bf16:hit:compiled,bf16:online:compiled"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warm_up = re.search(r"bf16:hit:compiled: warm-up \(compile\) [0-9.]+ s, steps \[([0-9., ]+)\], graphs ([0-9]+)",
                        done.stdout + done.stderr)
    assert warm_up and len(warm_up.group(1).split(",")) == 2 and int(warm_up.group(2)) > 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "user_stack_tiny.json").read_text())
    hit = {r["name"]: r for r in doc["rows"]}["bf16_hit_compiled"]
    assert (hit["run_mode"], hit["warmup_stopped_after"], len(hit["step_ms"])) == ("hit", 2, 4)
    assert hit["compile_s"] > 0 and hit["graphs"] == 0, hit
    online = {r["name"]: r for r in doc["rows"]}["bf16_online_compiled"]  # a dense first step, then sparse ones
    assert (online["run_mode"], online["warmup_stopped_after"], len(online["step_ms"])) == ("miss", 2, 4)
    assert online["graphs"] == 0, online
    assert not [n for n in doc["details"]["notes"] if "still compiled" in n]
