"""CI: the oldest-version run pins exactly the lower bounds setup.cfg declares, and runs every test file's
tests that reach the changing edges of transformers, peft and Lightning; a wheel carries the files the package reads."""

import ast
import configparser
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

from lowmem_aitextgen.native import native

ROOT = pathlib.Path(__file__).parent.parent


def test_ci_oldest_pins_are_the_declared_lower_bounds():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    floors = dict(re.findall(r"^\s*([\w-]+)>=([\d.]+)", config["options"]["install_requires"], re.M))
    pins = dict(re.findall(r"([\w-]+)==([\d.]+)", re.search(r'OLDEST="(.*)"', (ROOT / ".ci/run").read_text())[1]))
    assert pins and all(floors[name] == version.removesuffix(".0") or floors[name] == version
                        for name, version in pins.items()), (pins, floors)


EDGE_LIBRARIES = {"transformers", "peft", "pytorch_lightning", "lightning_fabric", "lightning"}


def _imported_libraries(tree: ast.Module) -> set[str]:
    """The top-level packages a test file imports anywhere (at the top or inside a test)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _marks_edges(tree: ast.Module) -> bool:
    """pytestmark = pytest.mark.edges, or @pytest.mark.edges on a test."""
    return any(isinstance(node, ast.Attribute) and node.attr == "edges" for node in ast.walk(tree))


def _why_not(tree: ast.Module) -> str | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NOT_AT_THE_EDGES" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def test_every_test_file_touching_transformers_peft_or_lightning_runs_at_the_oldest_versions_or_says_why_not():
    """.ci/run's second pass runs the oldest declared transformers, pytorch-lightning and peft on the tests marked
    `edges` only: a test file that imports one of them marks the tests that reach their changing edges, or says
    in NOT_AT_THE_EDGES why none does (and a file does not do both)."""
    unmarked, both = [], []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if not _imported_libraries(tree) & EDGE_LIBRARIES and not _marks_edges(tree):
            continue
        why = _why_not(tree)
        if _marks_edges(tree) and why:
            both.append(path.name)
        elif not _marks_edges(tree) and not (isinstance(why, str) and why.strip()):
            unmarked.append(path.name)
    assert not unmarked, f"mark their edge tests @pytest.mark.edges, or set NOT_AT_THE_EDGES = '<why>': {unmarked}"
    assert not both, both
    assert "edges:" in (ROOT / "pytest.ini").read_text()  # registered, so a typo in a mark fails (--strict-markers)


def test_ci_runs_the_readme_test_command_then_the_edges_at_the_oldest_versions():
    ci = (ROOT / ".ci/run").read_text()
    readme_command = re.search(r"```bash\n((?:apt-get .*&& )?python3 -m venv \.venv .*pytest -q)\n```", (ROOT / "README.md").read_text())
    assert readme_command and readme_command[1] in ci
    assert re.search(r"\.venv-oldest/bin/python -m pytest .*-m edges", ci)


def test_a_wheel_carries_every_file_of_the_package(tmp_path):
    """A wheel built from the tree (pip, as a user's `pip install .` builds one) holds every module of every wing
    and every file the package reads beside them: the server's page, our kernels' sources and headers (native.py
    builds them at first use).  setuptools reads setup.cfg's package_data, not this test: a list it misreads (a
    value over several lines is a list of lines) leaves the kernels out of an install."""
    source = tmp_path / "tree"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    with zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))) as wheel:
        held = {name for name in wheel.namelist() if name.startswith("lowmem_aitextgen/")}
    tree = {str(p.relative_to(ROOT)) for p in (ROOT / "lowmem_aitextgen").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    kernels = {str(path.relative_to(ROOT)) for path in (*native.SOURCES, *native.HEADERS)}
    assert held == tree and kernels | {"lowmem_aitextgen/serving/page.html"} <= held, sorted(held ^ tree)
