"""The device-call shell helpers of the user-stack benchmark pick their folders as their comments say."""

import subprocess

from conftest import REPO_ROOT

ENV = REPO_ROOT / "tests" / "benchmarks" / "user_stack_env.sh"


def weights_dir(*candidates) -> str:
    env = {"PATH": "/usr/bin:/bin", "US_WEIGHTS_DIRS": " ".join(map(str, candidates))}
    done = subprocess.run(["bash", "-c", f"source {ENV}; us_weights_dir"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_folder_holding_one_checkpoint_file_is_where_the_next_call_looks(tmp_path):
    """The bench writes only the files its rows load: a folder with the bf16 file alone is reused,
    not passed over for an empty one where the 33 GB file would be written again."""
    first, second = tmp_path / "tmp-weights", tmp_path / "shm-weights"
    first.mkdir(), second.mkdir()
    (second / "wan21_i2v_14b_bf16.safetensors").write_bytes(b"")
    assert weights_dir(first, second) == str(second)
    (first / "wan21_i2v_14b_fp8_scaled.safetensors").write_bytes(b"")
    assert weights_dir(first, second) == str(first)  # the first that holds any, in order


def test_with_no_checkpoint_written_yet_it_picks_tmp_or_shared_memory(tmp_path):
    assert weights_dir(tmp_path / "none") in ("/tmp/us-weights", "/dev/shm/us-weights")
