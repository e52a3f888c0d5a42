"""The pack loads through ComfyUI's own loader, leaks no bare module names, and survives
missing optional dependencies (triton, open_clip)."""

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.comfy

def run_loader(comfyui_path, tmp_path, blocked=""):
    link = tmp_path / "custom_nodes" / "some_folder_name"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(REPO_ROOT, target_is_directory=True)
    script = textwrap.dedent("""
        import asyncio, json, sys
        # None in sys.modules makes a package look uninstalled (ModuleNotFoundError, find_spec None)
        for name in filter(None, sys.argv[3].split(",")):
            sys.modules[name] = None
        sys.path.insert(0, sys.argv[1])
        import comfy.cli_args; comfy.cli_args.args.cpu = True
        import nodes
        ok = asyncio.run(nodes.load_custom_node(sys.argv[2]))
        bare = sorted(m for m in sys.modules if m.split(".")[0] in ("kernels", "chorus_core", "nodes.setup"))
        print(json.dumps({"ok": ok, "bare": bare, "nodes": sorted(n for n in nodes.NODE_CLASS_MAPPINGS if n.startswith("Chorus"))}))
    """)
    result = subprocess.run([sys.executable, "-c", script, str(comfyui_path), str(link), blocked],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_comfyui_loader_imports_the_pack_without_bare_module_names(comfyui_path, tmp_path):
    report = run_loader(comfyui_path, tmp_path)
    assert report["ok"] is True
    assert report["bare"] == []
    assert "ChorusTestbedRequest" in report["nodes"]


def test_pack_loads_without_triton_and_open_clip(comfyui_path, tmp_path):
    report = run_loader(comfyui_path, tmp_path, blocked="triton,open_clip")
    assert report["ok"] is True
    assert "ChorusTestbedRequest" in report["nodes"]
