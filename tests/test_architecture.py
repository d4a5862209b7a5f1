"""The layout's rules that lint-imports does not state: no import cycle among the pack's modules, no folder that
holds most of the product, every shipped source in a room of its own role (README's layout table names each); and
no test that asserts on a wall-clock time (times belong in the benchmarks: a loaded machine makes such a test
flaky)."""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "h3_fused_nvfp4"
NOT_PRODUCT = ("tests", "benchmarks", "scripts", "build", "example_workflows", "workflows", "web")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh")
MAX_FOLDER_SHARE = 0.40


def product_files() -> list[pathlib.Path]:
    files = []
    for path in REPO_ROOT.rglob("*"):
        relative = path.relative_to(REPO_ROOT)
        if path.is_file() and path.suffix in SOURCE_SUFFIXES and not any(
                part.startswith(".") for part in relative.parts) and relative.parts[0] not in NOT_PRODUCT:
            files.append(path)
    return files


def test_no_folder_holds_more_than_two_fifths_of_the_product():
    lines: dict[pathlib.Path, int] = {}
    for path in product_files():
        lines[path.parent] = lines.get(path.parent, 0) + len(path.read_text(encoding="utf-8").splitlines())
    total = sum(lines.values())
    shares = {str(folder.relative_to(REPO_ROOT)): count / total for folder, count in lines.items()}
    assert total > 3000 and len(shares) >= 5, shares
    assert max(shares.values()) <= MAX_FOLDER_SHARE, sorted(shares.items(), key=lambda kv: -kv[1])


def _import_graph():
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (tests/requirements-test.txt)")
    return grimp.build_graph(PACKAGE, cache_dir=None)


def test_no_import_cycle_among_the_packs_modules():
    graph = _import_graph()
    modules = sorted(m for m in graph.modules if m.startswith(PACKAGE + "."))
    edges = {m: sorted(d for d in graph.find_modules_directly_imported_by(m)
                       if d.startswith(PACKAGE + ".") and d != m) for m in modules}
    assert sum(map(len, edges.values())) > 40, "the graph looks empty: is the package found?"
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(module, path):
        state[module] = 1
        for target in edges.get(module, ()):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in modules:
        if module not in state:
            visit(module, [module])


def test_the_readme_names_every_room():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    rooms = {path.parent.relative_to(REPO_ROOT).as_posix() for path in product_files()} - {"."}
    missing = [room for room in sorted(rooms) if f"`{room}/`" not in readme]
    assert not missing, f"README's layout table does not name {missing}"


def committed_results() -> list[pathlib.Path]:
    return sorted((REPO_ROOT / "benchmarks").glob("*.json")) + sorted((REPO_ROOT / "scripts").rglob("*.json"))


def test_every_committed_result_is_cited_and_names_no_machine_path():
    readme = (REPO_ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    results = committed_results()
    assert results, "no committed results"
    for path in results:
        assert f"`{path.name}`" in readme, f"benchmarks/README.md does not cite {path.name}"
        text = path.read_text(encoding="utf-8")
        for prefix in ('"/tmp/', '"/work/', '"/root/', '"/home/', '"/opt/', " /tmp/", " /work/", " /root/", " /opt/"):
            assert prefix not in text, f"{path.name} records a machine path ({prefix.strip()}...)"


CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time",
          "process_time_ns"}


def _reads_a_clock(node: ast.AST, timed: set[str]) -> bool:
    """``node`` calls ``time.<clock>()`` or uses a name bound to such a reading."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in CLOCKS \
                and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "time":
            return True
        if isinstance(sub, ast.Name) and sub.id in timed:
            return True
    return False


def timed_assertions(source: str) -> list[int]:
    """Lines of ``assert`` statements that compare a clock reading (directly or through names bound to one)."""
    lines = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        timed: set[str] = set()
        for node in ast.walk(function):  # bindings first: a name bound to a reading taints every later use
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None \
                    and _reads_a_clock(node.value, timed):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                timed |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        lines += [node.lineno for node in ast.walk(function) if isinstance(node, ast.Assert)
                  and any(isinstance(c, ast.Compare) and _reads_a_clock(c, timed) for c in ast.walk(node.test))]
    return sorted(set(lines))


def test_timed_assertions_are_found():
    source = """
def test_a():
    t0 = time.perf_counter()
    work()
    seconds = time.perf_counter() - t0
    assert seconds < 5.0
def test_b():
    assert time.monotonic() - start < 1
def test_c():
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pass
    assert result == 3
"""
    assert timed_assertions(source) == [6, 8]


def test_no_test_asserts_on_a_wall_clock_time():
    found = {}
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        lines = timed_assertions(path.read_text(encoding="utf-8"))
        if lines:
            found[str(path.relative_to(REPO_ROOT))] = lines
    assert not found, f"tests asserting on a measured time (measure it in a benchmark instead): {found}"
