"""The layout's rules that lint-imports does not state: no import cycle among the pack's modules, no folder that
holds most of the product, every shipped source in a room of its own role (README's layout table names each); and
no test that asserts on a wall-clock time (times belong in the benchmarks: a loaded machine makes such a test
flaky)."""

from __future__ import annotations

import ast
import pathlib
import re

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


# The shared layers speak of no model family: a family's names live in its own folder (models/<family>/). The product's
# own name (the package, its environment variables, its log prefix) is not a family's word.
SHARED_LAYERS = ("blocks", "core", "kernels", "layout.py")
FAMILY_WORDS = {"h3", "minimax", "zimage", "lumina", "nextdit", "wan", "flux", "ltx", "qwen"}
PRODUCT_NAMES = re.compile(r"h3[ _-]fused[ _-]nvfp4|H3FN", re.IGNORECASE)


def _words(text: str) -> set[str]:
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", PRODUCT_NAMES.sub(" ", text))
    return set(re.findall(r"[a-z][a-z0-9]*", text.lower()))


def _python_names(source: str) -> set[str]:
    """Identifiers and string constants of a Python module, docstrings left out (they are its documentation)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return names


def _cuda_names(source: str) -> set[str]:
    """Identifiers and string literals of a CUDA source, comments left out."""
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.DOTALL)
    source = re.sub(r"//[^\n]*", " ", source)
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\"[^\"\n]*\"", source))


def family_words_in_shared_layers(root: pathlib.Path = REPO_ROOT) -> dict[str, set[str]]:
    found = {}
    for layer in SHARED_LAYERS:
        path = root / layer
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in SOURCE_SUFFIXES)
        for file in files:
            text = file.read_text(encoding="utf-8")
            names = _python_names(text) if file.suffix == ".py" else _cuda_names(text)
            words = set().union(*map(_words, names)) & FAMILY_WORDS if names else set()
            if words:
                found[file.relative_to(root).as_posix()] = words
    return found


def test_the_shared_layers_speak_of_no_model_family():
    assert family_words_in_shared_layers() == {}


def test_a_family_name_in_a_shared_layer_is_caught(tmp_path):
    for layer in SHARED_LAYERS:
        if (REPO_ROOT / layer).is_dir():
            (tmp_path / layer).mkdir()
    (tmp_path / "core" / "planted.py").write_text('"""Docstrings may say H3."""\nkind = "minimax_block"\n')
    (tmp_path / "kernels" / "planted.cu").write_text('// a comment may say H3\n__global__ void wan_norm() {}\n')
    (tmp_path / "layout.py").write_text('log = "H3 fused NVFP4: a product message"\n')
    assert family_words_in_shared_layers(tmp_path) == {"core/planted.py": {"minimax"}, "kernels/planted.cu": {"wan"}}


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
