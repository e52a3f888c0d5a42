"""README.md and docs/*.md point only at things that exist.

Every relative link and image resolves to a file or folder of the repository, every ``#anchor``
names a heading of its page (GitHub's heading slugs), and every repository path or results file
a page names in backticks (``tests/benchmarks/results/...``, a results file's bare name such as
``few_step_h200_720p.md``, a folder such as ``chorus_core/testbed/``) exists. A page moved or a
results file renamed fails here, not in front of a reader."""

import fnmatch
import re
import subprocess
import unicodedata
from pathlib import Path, PurePosixPath

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
RESULTS_PATH = re.compile(r"tests/benchmarks/results/[A-Za-z0-9_.*/-]+")
# Top-level folders of the repository: a backticked token that starts with one of them is a path.
TOP_LEVEL = ("tests/", "docs/", "chorus_core/", "nodes/", "kernels/", "example_workflows/", "web/")
FILE_SUFFIXES = (".md", ".json", ".log", ".txt", ".png")
# Backticked names that are not files of this repository (the members of a bank export tar).
NOT_REPO_FILES = {"entries.json"}


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: inline markup dropped, lower case, punctuation removed
    (letters, digits, '-' and '_' kept), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = []
    for char in text:
        if char == " ":
            kept.append("-")
        elif char in "-_" or unicodedata.category(char)[0] in "LN":
            kept.append(char)
    return "".join(kept)


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    """Every link and image target of ``page`` outside code (fenced blocks and code spans)."""
    targets = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        targets += LINK.findall(CODE_SPAN.sub("", line))
    return targets


def code_spans(page: Path) -> list[str]:
    spans = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        spans += CODE_SPAN.findall(line)
    return spans


def repo_files() -> list[str]:
    """Every file and folder a clone of the repository has (tracked, or new and not ignored), relative, with '/'.

    Asked of git rather than walked: a file only this working tree has (a venv, a downloaded template)
    must not make a citation pass here that fails on a clean clone.
    """
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    folders = {str(PurePosixPath(path).parent) for path in listed} - {"."}
    for folder in list(folders):
        folders.update(str(parent) for parent in PurePosixPath(folder).parents if str(parent) != ".")
    return sorted(set(listed) | folders)


def exists(path: str) -> bool:
    """``path`` (relative to the root, '*' allowed, a trailing '/' for a folder) names something."""
    path = path.rstrip("/")
    if "*" in path:
        return any(fnmatch.fnmatch(found, path) for found in repo_files())
    return (REPO_ROOT / path).exists()


def test_pages_are_found():
    names = {page.name for page in PAGES}
    assert "README.md" in names and len(PAGES) >= 8, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
            continue
        if REPO_ROOT not in linked.parents and linked != REPO_ROOT:
            broken.append(f"{target}: outside the repository")
            continue
        if anchor:
            if linked.suffix != ".md":
                broken.append(f"{target}: an anchor into a file that is not markdown")
            elif anchor not in anchors(linked):
                broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_cited_results_and_paths_exist(page):
    text = "\n".join(prose_lines(page.read_text(encoding="utf-8")))
    missing = []
    for path in RESULTS_PATH.findall(text):
        if not exists(path.rstrip(".")):
            missing.append(path)
    every_file = None
    for span in code_spans(page):
        token = span.strip()
        if " " in token or token in NOT_REPO_FILES or "<" in token or "..." in token:
            continue
        if token.startswith(TOP_LEVEL):
            if not exists(token):
                missing.append(token)
        elif token.endswith(FILE_SUFFIXES) and re.fullmatch(r"[A-Za-z0-9_.*/-]+", token):
            # A bare name or a partial path (a results file, a run log): some file of the
            # repository must end with it.
            every_file = every_file if every_file is not None else repo_files()
            pattern = "*/" + token
            if not any(found == token or fnmatch.fnmatch(found, pattern) for found in every_file):
                missing.append(token)
    assert not missing, f"{page.name} cites files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("heading, slug", [
    ("torch.compile", "torchcompile"),
    ("One bank for many machines (PostgreSQL)", "one-bank-for-many-machines-postgresql"),
    ("Beside core's nodes, steps and windows", "beside-cores-nodes-steps-and-windows"),
    ("Step-distilled Wan (4-8 steps, cfg 1)", "step-distilled-wan-4-8-steps-cfg-1"),
    ("`make test`, in parts", "make-test-in-parts"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug
