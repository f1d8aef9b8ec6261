"""The package's imports run one way: no circle, decisions import no technique, saving no training code.
Read from the source (every import, at module level or inside a function), nothing imported."""

import ast
import pathlib
import re

import lowmem_aitextgen

PACKAGE = pathlib.Path(lowmem_aitextgen.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
# Every module's floor, lowest first: a module imports only from its own floor or below (docs/architecture.md
# lists them).  A new module fails test_every_module_has_a_floor until it is given one.
FLOORS = {
    "facts": {"_compat", "hardware", "heap", "adapter_settings", "arguments", "saving"},
    "data and plan": {"plan", "TokenDataset", "tokenizers", "data"},
    "techniques": {"storage16", "chunked_loss", "optimizers", "four_bit", "lora", "adapters", "in_backward",
                   "checkpointing", "counting", "techniques", "sharding", "callbacks", "cpu", "heap_callbacks", "compiling"},
    "planner": {"step_time", "estimate", "budget", "oom"},
    "generation": {"decoding", "generation", "sampling", "batching", "engine", "kv_cache", "stepping",
                   "streaming", "packed16", "row_attention", "int8_kernels", "native", "native_int8",
                   "native_attention", "native_block", "native_bf16", "native_top_k", "huge_pages",
                   "transformers_decoding", "generate_options", "cutoffs", "detokenizer", "forms", "views"},
    "run": {"resume", "report", "outputs", "loading", "lightning_module", "evaluation", "run"},
    "serving": {"completions", "server_metrics", "serving"},
    "faces": {"aitextgen", "cards", "cli", "__init__", "colab", "train", "utils"},
}
TECHNIQUES = FLOORS["techniques"]


def floor_of(module: str) -> int:
    return next(i for i, modules in enumerate(FLOORS.values()) if module in modules)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import that climbs: 'module -> imported'."""
    return [f"{module} -> {imported}" for module, imports in sorted(graph.items()) for imported in sorted(imports)
            if floor_of(imported) > floor_of(module)]


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


def test_plan_data_imports_no_technique_and_saving_no_training_code():
    """The plan is data the techniques read; the planner (estimate, budget) sits above the techniques and asks
    them their facts (optimizers' names, what storage16 computes, what a step inside backward makes), which
    live beside each technique."""
    graph = package_imports()
    assert not graph["plan"] & TECHNIQUES, graph["plan"]
    assert graph["saving"] <= {"_compat", "heap", "hardware"}, graph["saving"]
    assert graph["hardware"] == set() and graph["heap"] == set()


def test_every_module_has_a_floor_and_one_only():
    modules = set(package_imports())
    placed = [module for floor in FLOORS.values() for module in floor]
    assert len(placed) == len(set(placed)), "a module is on two floors"
    assert modules == set(placed), (sorted(modules - set(placed)), sorted(set(placed) - modules))


def test_imports_only_go_down_or_stay_on_their_floor():
    assert upward({"plan": {"checkpointing"}, "checkpointing": {"plan"}}) == ["plan -> checkpointing"]  # the reader sees a climb
    assert not upward(package_imports())


def test_the_architecture_page_lists_the_floors_as_the_test_holds_them():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    for name, modules in FLOORS.items():
        line = next((row for row in text.splitlines() if row.startswith(f"| {name} |")), None)
        assert line is not None, f"docs/architecture.md has no row for the floor {name!r}"
        listed = set(re.findall(r"`([\w]+)\.py`", line))
        assert listed == modules, (name, sorted(listed ^ modules))
    described = {module for line in text.split("| module | holds |", 1)[1].splitlines() if line.startswith("| `")
                 for module in re.findall(r"`(\w+)\.py`", line.split("|")[1])}
    assert described == set(package_imports()), sorted(described ^ set(package_imports()))  # a row for each module


def test_the_library_patches_nothing_with_unittest():
    """A patch of another library's code for the whole process (unittest.mock) belongs in tests, not in the package."""
    for path in PACKAGE.glob("*.py"):
        imported = {alias.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(node, ast.ImportFrom)}
        assert not any(name.split(".")[0] == "unittest" for name in imported), path.name
