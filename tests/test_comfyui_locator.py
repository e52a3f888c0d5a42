"""Finding ComfyUI: COMFYUI_PATH, the containing checkout, the per-user cache, and a clear failure."""

import subprocess
import sys

import pytest

from chorus_core.comfy import comfyui_locator as loc
from conftest import REPO_ROOT


def fake_checkout(path):
    for name in ("main.py", "nodes.py", "folder_paths.py"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("")
    (path / "comfy").mkdir()
    (path / "comfy" / "__init__.py").write_text("")
    (path / "requirements.txt").write_text("torch\ntorchvision\nnumpy>=1.25.0\naiohttp>=3.11.8  # web\n#comment\n")
    return path


@pytest.fixture()
def nowhere(monkeypatch, tmp_path):
    """No COMFYUI_PATH, an empty cache, no network clone."""
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CHORUS_NO_CLONE", "1")
    return tmp_path


def test_comfyui_path_wins(nowhere, monkeypatch):
    checkout = fake_checkout(nowhere / "mine")
    monkeypatch.setenv("COMFYUI_PATH", str(checkout))
    assert loc.locate_comfyui(pack_dir=nowhere / "pack") == checkout.resolve()


def test_containing_checkout_is_found(nowhere):
    checkout = fake_checkout(nowhere / "ComfyUI")
    pack = checkout / "custom_nodes" / "any_name"
    pack.mkdir(parents=True)
    assert loc.locate_comfyui(pack_dir=pack) == checkout.resolve()


def test_per_user_cache_is_used(nowhere):
    cached = fake_checkout(loc.cached_checkout_dir())
    assert loc.locate_comfyui(pack_dir=nowhere / "pack") == cached


def test_nothing_found_names_every_place_and_what_to_set(nowhere, monkeypatch):
    monkeypatch.setenv("COMFYUI_PATH", str(nowhere / "not_comfy"))
    with pytest.raises(loc.ComfyUINotFound) as err:
        loc.locate_comfyui(pack_dir=nowhere / "pack")
    message = str(err.value)
    for place in ("COMFYUI_PATH=", "containing checkout", "per-user cache", "git clone: disabled"):
        assert place in message
    assert "Fix: set COMFYUI_PATH" in message and loc.RELEASES[loc.OLDEST_VERSION][:10] in message


def test_command_line_fails_loudly_without_comfyui(nowhere):
    env = {"PATH": "/usr/bin:/bin", "CHORUS_CACHE_DIR": str(nowhere / "cache"), "CHORUS_NO_CLONE": "1"}
    result = subprocess.run([sys.executable, "-m", "chorus_core.comfy.comfyui_locator"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "ComfyUI was not found" in result.stderr


def test_setup_looks_for_comfyui_before_it_downloads_torch(nowhere):
    """Offline and without ComfyUI, `make setup` (and so `make demo`) stops at once and says how
    to fill the cache, not after a multi-GB torch download. A torch requirement that pip cannot
    install stands in for the download: reaching it would fail with pip's error instead."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(nowhere), "CHORUS_CACHE_DIR": str(nowhere / "cache"),
           "CHORUS_NO_CLONE": "1"}
    result = subprocess.run(["make", "-C", str(REPO_ROOT), "setup", f"PYTHON={sys.executable}",
                             f"VENV={nowhere / 'venv'}", f"TORCH={nowhere / 'not-a-torch-wheel.whl'}"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "ComfyUI was not found" in result.stderr and "--install-from" in result.stderr, result.stderr
    assert "not-a-torch-wheel" not in result.stdout + result.stderr  # pip never ran


def test_requirements_drop_the_torch_family_and_add_requests(nowhere):
    checkout = fake_checkout(nowhere / "c")
    assert loc.comfyui_requirements(checkout) == ["numpy>=1.25.0", "aiohttp>=3.11.8", "requests"]


def test_install_from_a_local_git_repository(nowhere, tmp_path, monkeypatch):
    repo = fake_checkout(tmp_path / "src")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setitem(loc.RELEASES, loc.CURRENT_VERSION, head)
    monkeypatch.setenv(loc.VERSION_ENV, loc.CURRENT_VERSION)
    dest = loc.install_from_git_dir(repo / ".git")
    assert loc.is_comfyui_checkout(dest) and dest == loc.cached_checkout_dir() == loc.cache_root() / f"comfyui-{head}"
    monkeypatch.delenv(loc.VERSION_ENV)
    assert loc.cached_checkout_dir() != dest  # the oldest release has a folder of its own


def test_a_failed_clone_leaves_nothing_in_the_cache(nowhere, monkeypatch):
    """The fetch fails (an unreachable remote): no empty or half-filled folder stays behind."""
    monkeypatch.setattr(loc, "COMFYUI_GIT_URL", str(nowhere / "no-such-remote.git"))
    cache = nowhere / "cache"
    cache.mkdir()
    with pytest.raises(RuntimeError, match=r"git -C .* fetch\.\.\. failed: "):
        loc.clone_pinned(cache / "comfyui-pinned")
    assert list(cache.iterdir()) == []


def test_a_failed_clone_through_the_locator_names_the_failure_and_leaves_nothing(nowhere, monkeypatch):
    monkeypatch.setattr(loc, "COMFYUI_GIT_URL", str(nowhere / "no-such-remote.git"))
    monkeypatch.delenv("CHORUS_NO_CLONE")
    with pytest.raises(loc.ComfyUINotFound, match="fetch... failed"):
        loc.locate_comfyui(pack_dir=nowhere / "pack", allow_clone=True)
    assert list((nowhere / "cache").iterdir()) == []


def test_each_pinned_release_has_its_own_cache_folder_and_the_variable_picks_one(nowhere, monkeypatch):
    oldest = fake_checkout(loc.cached_checkout_dir(loc.OLDEST_VERSION))
    current = fake_checkout(loc.cached_checkout_dir(loc.CURRENT_VERSION))
    assert loc.locate_comfyui(pack_dir=nowhere / "pack") == oldest  # the default
    monkeypatch.setenv(loc.VERSION_ENV, loc.CURRENT_VERSION)
    assert loc.locate_comfyui(pack_dir=nowhere / "pack") == current


def test_an_unknown_release_is_refused_with_the_ones_there_are(nowhere, monkeypatch):
    monkeypatch.setenv(loc.VERSION_ENV, "0.4.0")
    with pytest.raises(loc.ComfyUINotFound, match=r"0\.4\.0 is not a pinned ComfyUI release; use one of 0\.3\.64, 0\.19\.3"):
        loc.locate_comfyui(pack_dir=nowhere / "pack")


def test_an_untested_running_release_gets_one_line_naming_the_tested_ones():
    assert loc.untested_version_line("0.3.64") is None and loc.untested_version_line("0.19.3") is None
    line = loc.untested_version_line("0.46.0")
    assert line.startswith("Chorus: ComfyUI 0.46.0 is untested; Chorus was tested on ComfyUI 0.3.64 and 0.19.3.")
    assert "\n" not in line and "(version unknown)" in loc.untested_version_line(None)
