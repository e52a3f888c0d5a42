"""The runtime code (nodes/, chorus_core/ outside its testbed, kernels/) keeps the shape
docs/development.md describes: no import circle, no private name imported from another module, no
module over 600 lines, and nothing in it imports the testbed. What ships of the testbed is only what
the demo and the testbed request node need (the workload and the tiny model); the research harness
lives in tests/testbed/."""

import ast
from pathlib import Path

from conftest import REPO_ROOT

PACKAGES = ("nodes", "chorus_core", "kernels")
MAX_LINES = 600


def runtime_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every runtime module."""
    found = {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            if "testbed" in parts or "__pycache__" in parts:
                continue
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def raw_imports(module: str, path: Path, tree: ast.AST) -> list[tuple[str, str]]:
    """(dotted target, imported name) of every import in ``tree``, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    pairs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            pairs += [(target, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            pairs += [(alias.name, "") for alias in node.names]
    return pairs


def imported(module: str, path: Path, tree: ast.AST, known: dict) -> list[tuple[str, str]]:
    """(runtime module, imported name) for every import of a runtime module in ``tree``."""
    pairs = []
    for target, name in raw_imports(module, path, tree):
        full = f"{target}.{name}"
        pairs.append((owner(full if full in known else target, known), name))
    return [(t, name) for t, name in pairs if t]


def owner(target: str, known: dict) -> str:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target


def graph() -> tuple[dict, list, dict]:
    known = runtime_modules()
    edges, private, sizes = {}, [], {}
    for module, path in known.items():
        source = path.read_text()
        sizes[module] = source.count("\n")
        for target, name in imported(module, path, ast.parse(source), known):
            if target == module or module.startswith(target + ".") and known[target].name == "__init__.py":
                continue  # a package's own __init__ is not another module
            edges.setdefault(module, set()).add(target)
            if name.startswith("_") and not name.startswith("__"):
                private.append(f"{module}: {name} from {target}")
    return edges, private, sizes


def circles(edges: dict) -> list[list[str]]:
    """Every strongly connected group of more than one module (an import circle)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_the_runtime_has_no_import_circle_and_no_private_import_across_modules():
    edges, private, _ = graph()
    assert circles(edges) == []
    assert private == []


def test_no_runtime_module_is_over_600_lines():
    _, _, sizes = graph()
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_the_runtime_never_imports_the_testbed():
    found = [f"{module}: {target}" for module, path in runtime_modules().items()
             for target, name in raw_imports(module, path, ast.parse(path.read_text()))
             if "testbed" in f"{target}.{name}".split(".")]
    assert found == []


def test_the_runtime_keeps_only_the_testbed_parts_the_demo_and_the_node_need():
    """chorus_core/testbed/ holds the procedural workload and the random tiny model, which import
    nothing of the research harness in tests/testbed/; the testbed node uses only the workload."""
    testbed = REPO_ROOT / "chorus_core" / "testbed"
    assert sorted(p.name for p in testbed.glob("*.py")) == ["__init__.py", "tiny_wan.py", "workload.py"]
    for path in [*testbed.glob("*.py"), REPO_ROOT / "nodes" / "testbed.py"]:
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        targets = {target for target, _ in raw_imports(module, path, ast.parse(path.read_text()))}
        assert not [t for t in targets if t == "tests" or t.startswith("tests.")], path
        assert not [t for t in targets if ".testbed." in f".{t}." and not t.endswith(("testbed.workload", "testbed.tiny_wan"))
                    and t not in ("chorus_core.testbed", "nodes.testbed")], (path, targets)


def test_the_rooms_of_chorus_core_import_nothing_when_imported():
    """chorus_core's rooms (attention/, reuse/, guidance/, comfy/, testbed/) are plain folders:
    their ``__init__`` only describes them, so importing one module never loads its neighbours
    (``python -m chorus_core.comfy.comfyui_locator`` runs before torch is installed). The bank's
    ``__init__`` is its public API and is the one package that imports."""
    rooms = sorted(p.parent.name for p in (REPO_ROOT / "chorus_core").glob("*/__init__.py"))
    assert rooms == ["attention", "bank", "comfy", "guidance", "reuse", "testbed"]
    importing = {}
    for init in [REPO_ROOT / "chorus_core" / "__init__.py",
                 *(REPO_ROOT / "chorus_core" / room / "__init__.py" for room in rooms if room != "bank")]:
        tree = ast.parse(init.read_text())
        found = [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        if found:
            importing[str(init.relative_to(REPO_ROOT))] = found
    assert importing == {}


def test_the_checker_finds_a_circle_and_a_private_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from .b import _hidden\nfrom . import c\nfrom .testbed import probe\n")
    known = {"p": Path("p/__init__.py"), "p.a": Path("p/a.py"), "p.b": Path("p/b.py"), "p.c": Path("p/c.py")}
    assert imported("p.a", Path("p/a.py"), tree, known) == [("p.b", "_hidden"), ("p.c", "c"), ("p", "probe")]
    assert ("p.testbed", "probe") in raw_imports("p.a", Path("p/a.py"), tree)


# Each room may import only the rooms before it in this order (comfy/ stands alone; the root
# modules _siblings and quality are shared helpers any room may use).
ROOM_ORDER = ("kernels", "chorus_core.bank", "chorus_core.attention", "chorus_core.guidance", "chorus_core.reuse")


def room_of(module: str) -> str:
    for room in ROOM_ORDER + ("chorus_core.comfy", "nodes"):
        if module == room or module.startswith(room + "."):
            return room
    return "shared"


def test_the_rooms_depend_one_way():
    """bank and kernels know nothing of the others, attention uses the bank, guidance builds on
    attention, reuse on all of them: what docs/development.md's data path shows."""
    edges, _, _ = graph()
    backwards = []
    for module, targets in edges.items():
        room = room_of(module)
        for target in targets:
            other = room_of(target)
            if other == room or other == "shared" or room in ("nodes", "shared"):
                continue
            allowed = other in ROOM_ORDER and room in ROOM_ORDER and ROOM_ORDER.index(other) < ROOM_ORDER.index(room)
            if not allowed:
                backwards.append(f"{module} -> {target}")
    assert backwards == []
