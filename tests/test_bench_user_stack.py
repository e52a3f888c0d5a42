"""The user-stack benchmark runs end to end at a tiny size on the CPU, :sage rows included."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.comfy
BENCH = REPO_ROOT / "tests" / "benchmarks" / "bench_user_stack.py"


def test_sage_rows_run_comfyuis_sage_attention_and_chorus_leaves_it_the_dense_calls(tmp_path, comfyui_path):
    rows = "bf16:dense:eager,bf16:dense:eager:sage,bf16:miss:eager,bf16:hit:eager:sage,bf16:hit:eager"
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path, "--weights-dir", tmp_path / "w",
                           "--bank", tmp_path / "bank", "--rows", rows], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COMFYUI_PATH": str(comfyui_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = {r["name"]: r for r in json.loads((tmp_path / "user_stack_tiny.json").read_text())["rows"]}
    assert result["bf16_dense_eager"]["attention"] == "cudnn_sdpa"
    assert result["bf16_dense_eager_sage"]["attention"] == "sageattention_1.0.6"
    assert result["bf16_dense_eager_sage"]["role"] == "dense"  # a dense baseline like the others
    # ComfyUI's attention_sage ran (on CPU tensors it falls back to torch, and says so)
    assert "Error running sage attention" in done.stdout + done.stderr
    assert "SageAttention" in result["bf16_hit_eager_sage"]["dense_backend"]
    assert "SageAttention" not in (result["bf16_hit_eager"]["dense_backend"] or "")  # put back after the row
    assert result["bf16_hit_eager_sage"]["run_mode"] == "hit"


def test_a_row_names_only_known_attentions_and_a_bad_one_stops_the_call_at_once(tmp_path):
    """In a process of its own: the benchmark puts the repository first on sys.path, where its
    nodes/ package would stand in for ComfyUI's nodes module in every later test."""
    for bad in ("bf16:hit:compiled:flash", "bf16:hit:compiled:sage:x", "bf16:dense"):
        done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", tmp_path, "--weights-dir",
                               tmp_path / "never", "--rows", f"bf16:dense:eager,{bad}"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and f"bad row {bad!r}" in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "never").exists()  # nothing was built before the rows were checked
