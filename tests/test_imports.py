"""The package's imports run one way: no circle, decisions import no technique, saving no training code.
Read from the source (every import, at module level or inside a function), nothing imported."""

import ast
import pathlib

import lowmem_aitextgen

PACKAGE = pathlib.Path(lowmem_aitextgen.__file__).parent
TECHNIQUES = {"storage16", "memory", "lora", "cpu", "chunked_loss", "optimizers", "compiling"}


def package_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    graph = {}
    for path in PACKAGE.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
                imported.update(name.split(".")[0] for name in names if name.split(".")[0] in modules)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowmem_aitextgen."):
                imported.add(node.module.split(".")[1])
        graph[path.stem] = imported - {path.stem}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the modules along it, or None."""
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (circle := visit(imported, path + [imported])):
                return circle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module, [module])):
            return circle
    return None


def test_the_reader_sees_a_circle_where_there_is_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = package_imports()
    assert "plan" in graph["run"] and "saving" in graph["TokenDataset"]  # function-level imports are read too


def test_no_module_imports_itself_back():
    circle = find_circle(package_imports())
    assert circle is None, " -> ".join(circle)


def test_decisions_import_no_technique_and_saving_no_training_code():
    graph = package_imports()
    assert not graph["plan"] & TECHNIQUES, graph["plan"]
    assert not graph["budget"] & TECHNIQUES, graph["budget"]
    assert graph["saving"] <= {"_compat", "heap", "hardware"}, graph["saving"]
    assert graph["hardware"] == set() and graph["heap"] == set()
