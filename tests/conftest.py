"""Shared fixtures: the pinned ComfyUI, the tiny Wan2.1-I2V checkpoint, a live server.

Three layers of tests use them: pure-library tests (no fixture here needed), in-process
ComfyUI tests on the CPU (``comfy_runtime``) and end-to-end tests against a real
``main.py --cpu`` server (``comfy_server``). A missing ComfyUI fails loudly, never skips.
"""

import os
import sys
from pathlib import Path

# Triton kernels run in its interpreter on CPU tensors unless a GPU run asks otherwise;
# this must happen before anything imports triton.
if os.environ.get("CHORUS_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, REPO_ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402

from chorus_core.comfy.comfyui_locator import locate_comfyui, prepare_in_process  # noqa: E402

ARTIFACTS = REPO_ROOT / "tests" / "artifacts"


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    """The pinned ComfyUI checkout; raises ComfyUINotFound (with what to set) when absent."""
    return locate_comfyui(allow_clone=os.environ.get("CHORUS_NO_CLONE") != "1")


@pytest.fixture(scope="session")
def comfy_runtime(comfyui_path):
    """ComfyUI importable in this process, on the CPU."""
    prepare_in_process(comfyui_path, cpu=True)
    import comfy.model_management  # noqa: F401  (reads --cpu once)

    return comfyui_path


@pytest.fixture(scope="session")
def tiny_wan_file(tmp_path_factory, comfy_runtime) -> Path:
    from chorus_core.testbed.tiny_wan import save_tiny_wan_i2v

    return save_tiny_wan_i2v(tmp_path_factory.mktemp("models") / "chorus_tiny_wan21_i2v.safetensors")


@pytest.fixture()
def tiny_wan_patcher(tiny_wan_file):
    """A fresh ComfyUI ModelPatcher of the tiny model, loaded as UNETLoader loads it."""
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(tiny_wan_file))


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory, comfyui_path):
    """A real ComfyUI ``main.py --cpu`` with the pack and the tiny model; stopped by PID at the end."""
    from chorus_core.comfy.comfyui_process import ComfyServer, prepare_base_directory
    from workflows import TINY_MODEL_NAME

    base = prepare_base_directory(tmp_path_factory.mktemp("comfy_base"))
    _save_tiny_model_in_subprocess(comfyui_path, base / "models" / "diffusion_models" / TINY_MODEL_NAME)
    yield from serve(ComfyServer(base, comfyui=comfyui_path), "comfyui_server.log")


def serve(server, log_name: str):
    """Start ``server``, yield it, stop it and keep its log under tests/artifacts (for a fixture)."""
    server.start()
    try:
        yield server
    finally:
        server.stop()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / log_name).write_text(server.log_text())


def _save_tiny_model_in_subprocess(comfyui_path, target):
    """Build the checkpoint in a child process so the test process never imports ComfyUI here."""
    import subprocess

    code = ("import sys; from chorus_core.comfy.comfyui_locator import prepare_in_process; "
            f"prepare_in_process({str(comfyui_path)!r}); from chorus_core.testbed.tiny_wan import save_tiny_wan_i2v; "
            f"save_tiny_wan_i2v({str(target)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def pytest_collection_modifyitems(config, items):
    """Every test that needs ComfyUI is marked ``comfy`` (fixtures included), so that ``make test``
    can run exactly those again against the current ComfyUI release."""
    for item in items:
        if "comfyui_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.comfy)
