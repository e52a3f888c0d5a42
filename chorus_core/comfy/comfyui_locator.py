"""Find the ComfyUI that Chorus runs against, the way users have it.

Tried in order: ``COMFYUI_PATH``; the ComfyUI checkout that contains this pack
(``ComfyUI/custom_nodes/<pack>``); a per-user cache folder holding a pinned release;
a ``git clone`` of that release where a network allows. When none works,
:class:`ComfyUINotFound` names each place tried and what to set.

Two releases are pinned (:data:`RELEASES`): the oldest supported and the current one; the test
suite runs against both. ``CHORUS_COMFYUI_VERSION`` picks which one the cache and the clone
hold (default: the oldest).

Command line::

    python -m chorus_core.comfy.comfyui_locator                  # print the path found
    python -m chorus_core.comfy.comfyui_locator --no-clone        # never touch the network
    python -m chorus_core.comfy.comfyui_locator --install-from GIT_DIR   # fill the cache from a local git repo
    python -m chorus_core.comfy.comfyui_locator --write-requirements FILE  # ComfyUI's pip requirements, torch excluded
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# ComfyUI release -> upstream commit. 0.3.64 is the oldest supported; 0.19.3 the newest whole tree
# that can be had here (upstream's own release commit).
RELEASES = {
    "0.3.64": "a125cd84b054a57729b5eecab930ca9408719832",
    "0.19.3": "3086026401180c9216bcb6ace442a4e3587d2c66",
}
OLDEST_VERSION, CURRENT_VERSION = "0.3.64", "0.19.3"
VERSION_ENV = "CHORUS_COMFYUI_VERSION"
COMFYUI_GIT_URL = "https://github.com/Comfy-Org/ComfyUI.git"
PACK_DIR = Path(__file__).resolve().parents[2]
# torch comes from the project's own set-up (a CPU-capable build); ComfyUI's unpinned
# torch lines would pull a different multi-GB build.
_TORCH_REQUIREMENTS = {"torch", "torchvision", "torchaudio"}
# Missing from the snapshot this project is built from; ComfyUI only needs it for one
# text encoder that Wan does not use.
_OPTIONAL_PATHS = ("comfy/text_encoders/llama_tokenizer/tokenizer.json",
                   "comfy/text_encoders/qwen35_tokenizer/vocab.json")


class ComfyUINotFound(RuntimeError):
    """No usable ComfyUI checkout was found; the message lists every place tried."""


def is_comfyui_checkout(path: Path) -> bool:
    """True when ``path`` looks like a ComfyUI source tree (``main.py``, ``nodes.py``, ``comfy/``)."""
    path = Path(path)
    return all((path / name).exists() for name in ("main.py", "nodes.py", "folder_paths.py", "comfy"))


def cache_root() -> Path:
    """Per-user cache folder: ``$CHORUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/chorus``, else ``~/.cache/chorus``."""
    if os.environ.get("CHORUS_CACHE_DIR"):
        return Path(os.environ["CHORUS_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(xdg) / "chorus"


def untested_version_line(version: str | None) -> str | None:
    """The start-up line for a ComfyUI release the suite has not run on; None for a pinned one."""
    if version in RELEASES:
        return None
    return (f"Chorus: ComfyUI {version or '(version unknown)'} is untested; Chorus was tested on ComfyUI "
            f"{' and '.join(RELEASES)}. If generations fail or never hit, try one of those and report the "
            "ComfyUI version with the log.")


def selected_version() -> str:
    """The pinned release this process uses: ``$CHORUS_COMFYUI_VERSION``, else the oldest supported."""
    version = os.environ.get(VERSION_ENV) or OLDEST_VERSION
    if version not in RELEASES:
        raise ComfyUINotFound(f"{VERSION_ENV}={version} is not a pinned ComfyUI release; "
                              f"use one of {', '.join(RELEASES)} or unset it.")
    return version


def pinned_commit(version: str | None = None) -> str:
    return RELEASES[version or selected_version()]


def cached_checkout_dir(version: str | None = None) -> Path:
    """Where a pinned release lives in the per-user cache."""
    return cache_root() / f"comfyui-{pinned_commit(version)}"


def containing_checkout(pack_dir: Path = PACK_DIR) -> Path | None:
    """The ComfyUI checkout whose ``custom_nodes`` folder holds this pack, if any."""
    parent = Path(pack_dir).resolve().parent
    if parent.name == "custom_nodes" and is_comfyui_checkout(parent.parent):
        return parent.parent
    return None


def clone_pinned(dest: Path, version: str | None = None) -> None:
    """Shallow-fetch a pinned release into ``dest``; raises ``RuntimeError`` saying why it failed."""
    dest, commit = Path(dest), pinned_commit(version)
    tmp = Path(tempfile.mkdtemp(prefix="comfyui-clone-", dir=dest.parent))
    steps = [
        ["git", "init", "-q", str(tmp)],
        ["git", "-C", str(tmp), "fetch", "-q", "--depth", "1", COMFYUI_GIT_URL, commit],
        ["git", "-C", str(tmp), "checkout", "-q", "FETCH_HEAD"],
    ]
    try:
        for step in steps:
            result = subprocess.run(step, capture_output=True, text=True, timeout=600)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(step[:4])}... failed: {result.stderr.strip()[-300:]}")
        tmp.rename(dest)
    except BaseException:
        # a failed or interrupted clone leaves nothing in the cache: the next run starts clean
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def install_from_git_dir(git_dir: Path, dest: Path | None = None, version: str | None = None) -> Path:
    """Export a pinned release from a local ComfyUI git repository into the cache.

    Blobs the repository lacks are tolerated only for :data:`_OPTIONAL_PATHS`.
    """
    commit = pinned_commit(version)
    dest = Path(dest or cached_checkout_dir(version))
    dest.parent.mkdir(parents=True, exist_ok=True)
    excludes = [f":(exclude){p}" for p in _OPTIONAL_PATHS]
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        archive = Path(tmp) / "comfyui.tar"
        cmd = ["git", f"--git-dir={git_dir}", "archive", "--format=tar", "-o", str(archive),
               commit, "--", ".", *excludes]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not archive.exists():
            raise RuntimeError(f"git archive of {commit} from {git_dir} failed: {result.stderr.strip()}")
        staging = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        if not is_comfyui_checkout(staging):
            raise RuntimeError(f"{git_dir} at {commit} does not hold a ComfyUI tree")
        if dest.exists():
            raise RuntimeError(f"{dest} already exists; remove it first to reinstall")
        staging.rename(dest)
    return dest


def locate_comfyui(pack_dir: Path = PACK_DIR, allow_clone: bool = True) -> Path:
    """Return the ComfyUI checkout to use, trying each documented place in order."""
    tried: list[str] = []
    env_path = os.environ.get("COMFYUI_PATH")
    if env_path:
        if is_comfyui_checkout(Path(env_path)):
            return Path(env_path).resolve()
        tried.append(f"COMFYUI_PATH={env_path}: not a ComfyUI checkout (no main.py/nodes.py/comfy/)")
    else:
        tried.append("COMFYUI_PATH: not set")

    containing = containing_checkout(pack_dir)
    if containing:
        return containing
    tried.append(f"containing checkout: {Path(pack_dir).resolve().parent} is not ComfyUI/custom_nodes")

    cached = cached_checkout_dir()
    if is_comfyui_checkout(cached):
        return cached
    tried.append(f"per-user cache: {cached} does not exist")

    if allow_clone and os.environ.get("CHORUS_NO_CLONE") != "1":
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            clone_pinned(cached)
            return cached
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            tried.append(f"git clone {COMFYUI_GIT_URL} @ {pinned_commit()}: {exc}")
    else:
        tried.append("git clone: disabled (--no-clone or CHORUS_NO_CLONE=1)")

    raise ComfyUINotFound(
        "ComfyUI was not found. Tried, in order:\n  - " + "\n  - ".join(tried) + "\n"
        f"Fix: set COMFYUI_PATH to a ComfyUI checkout (commit {pinned_commit()[:10]}, v{selected_version()}), "
        "or install this pack into ComfyUI/custom_nodes, "
        "or fill the cache from a local clone: python -m chorus_core.comfy.comfyui_locator --install-from PATH/TO/ComfyUI/.git"
    )


def comfyui_requirements(comfyui: Path) -> list[str]:
    """ComfyUI's pip requirements without the torch family (installed separately)."""
    lines = []
    for raw in (Path(comfyui) / "requirements.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        name = line.split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip().lower()
        if line and name not in _TORCH_REQUIREMENTS:
            lines.append(line)
    return lines + ["requests"]  # imported by ComfyUI but missing from its list


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chorus_core.comfy.comfyui_locator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-clone", action="store_true", help="never try the network")
    parser.add_argument("--install-from", metavar="GIT_DIR", help="fill the per-user cache from a local ComfyUI git repository")
    parser.add_argument("--write-requirements", metavar="FILE", help="write ComfyUI's pip requirements (torch excluded) to FILE")
    args = parser.parse_args(argv)
    try:
        if args.install_from:
            print(install_from_git_dir(Path(args.install_from)))
            return 0
        comfyui = locate_comfyui(allow_clone=not args.no_clone)
    except (ComfyUINotFound, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write_requirements:
        Path(args.write_requirements).write_text("\n".join(comfyui_requirements(comfyui)) + "\n")
    print(comfyui)
    return 0



def prepare_in_process(comfyui: Path | None = None, cpu: bool = True, dynamic_vram: bool = False) -> Path:
    """Make ComfyUI importable in this process (tests, tools); CPU-only unless ``cpu=False``.

    ComfyUI parses no command line when imported this way, so its defaults apply; we only
    force ``--cpu`` before ``comfy.model_management`` reads the arguments. ``dynamic_vram``
    loads comfy-aimdo's native library now, before ComfyUI's model code binds to it, as its
    ``main.py`` does; :func:`enable_dynamic_vram` then starts it.
    """
    comfyui = Path(comfyui or locate_comfyui())
    if str(comfyui) not in sys.path:
        sys.path.insert(0, str(comfyui))
    import comfy.cli_args

    comfy.cli_args.args.cpu = cpu
    if dynamic_vram:
        if "class ModelPatcherDynamic" not in (comfyui / "comfy" / "model_patcher.py").read_text():
            raise DynamicVRAMUnavailable(NO_DYNAMIC_VRAM)  # checked unimported: the import would bind comfy-aimdo
        load_aimdo_library()
    return comfyui


NO_DYNAMIC_VRAM = "this ComfyUI has no DynamicVRAM (it came with 0.19): leave it off"


def load_aimdo_library() -> None:
    """comfy-aimdo's native library, loaded before ``comfy.model_patcher`` is imported: its
    ``model_vbar`` module binds the library once, when first imported."""
    if "comfy.model_patcher" in sys.modules and "comfy_aimdo.control" not in sys.modules:
        raise DynamicVRAMUnavailable("ComfyUI's model code was imported before comfy-aimdo's library was loaded: "
                                     "prepare ComfyUI with dynamic_vram=True before anything imports comfy")
    try:
        import comfy_aimdo.control
    except ImportError as exc:
        raise DynamicVRAMUnavailable(f"comfy-aimdo is not importable ({exc}): pip install comfy-aimdo") from exc
    if not comfy_aimdo.control.init():
        raise DynamicVRAMUnavailable("comfy-aimdo did not load its native library: install its platform wheel "
                                     "(manylinux), not the py3-none-any one")


class DynamicVRAMUnavailable(RuntimeError):
    """ComfyUI's DynamicVRAM cannot start in this process; the message says why and what to do."""


def enable_dynamic_vram() -> str:
    """Start ComfyUI's DynamicVRAM in this process as its ``main.py`` does on an NVIDIA GPU.

    From 0.19 a ComfyUI server on Linux with an NVIDIA GPU, torch 2.8 or newer and a working
    comfy-aimdo loads every model through ``ModelPatcherDynamic`` (weights memory-mapped, cast into
    a virtual VRAM buffer as layers run); a process that only imports ComfyUI keeps the legacy
    ModelPatcher. Call after ``prepare_in_process(cpu=False, dynamic_vram=True)`` and before any
    model is loaded. Returns what is on, e.g. ``"DynamicVRAM (comfy-aimdo 0.6.0, cuda:0)"``.

    :raises DynamicVRAMUnavailable: this ComfyUI has no DynamicVRAM, comfy-aimdo is missing or has
        no native library, or it could not take the GPU
    """
    import comfy.model_management
    import comfy.model_patcher

    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        raise DynamicVRAMUnavailable(NO_DYNAMIC_VRAM)
    import comfy.memory_management
    import comfy_aimdo.control
    import comfy_aimdo.model_vbar
    from importlib.metadata import version

    aimdo = version("comfy-aimdo")
    if comfy_aimdo.model_vbar.lib is None:  # bound before the library was loaded: every model load would fail
        raise DynamicVRAMUnavailable("comfy-aimdo's library was not loaded before ComfyUI's model code: "
                                     "prepare ComfyUI with dynamic_vram=True before anything imports comfy")
    device = comfy.model_management.get_torch_device()
    if device.type != "cuda":
        raise DynamicVRAMUnavailable(f"DynamicVRAM needs an NVIDIA GPU; ComfyUI runs on {device}")
    if not comfy_aimdo.control.init_device(device.index or 0):
        raise DynamicVRAMUnavailable(f"comfy-aimdo {aimdo} could not take {device}")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return f"DynamicVRAM (comfy-aimdo {aimdo}, {device})"


if __name__ == "__main__":
    sys.exit(main())
