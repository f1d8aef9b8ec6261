"""The package's imports run one way: no circle, decisions import no technique, saving no training code.
Read from the source (every import, at module level or inside a function), nothing imported."""

import ast
import importlib
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
    "generation": {"decoding", "generation", "sampling", "engine", "kv_cache", "stepping",
                   "streaming", "packed16", "row_attention", "int8_kernels", "native", "native_int8",
                   "native_attention", "native_block", "native_bf16", "native_top_k", "huge_pages",
                   "transformers_decoding", "generate_options", "cutoffs", "detokenizer", "forms",
                   "views"},
    "run": {"resume", "report", "outputs", "loading", "lightning_module", "evaluation", "run"},
    "serving": {"completions", "server_metrics", "serving", "batching"},
    "faces": {"aitextgen", "cards", "cli", "__init__", "colab", "train", "utils"},
}
TECHNIQUES = FLOORS["techniques"]
# Each wing (a folder of the package) and the floors its modules stand on; the package's own top holds what users
# import (the faces), the facts every wing reads, and loading (models read back, for train() and generate() alike)
WINGS = {"training": {"facts", "data and plan", "techniques", "planner", "run"}, "generation": {"generation"},
         "native": {"generation"}, "serving": {"serving"}, "": {"facts", "data and plan", "run", "faces"}}


def floor_of(module: str) -> int:
    return next(i for i, modules in enumerate(FLOORS.values()) if module in modules)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import that climbs: 'module -> imported'."""
    return [f"{module} -> {imported}" for module, imports in sorted(graph.items()) for imported in sorted(imports)
            if floor_of(imported) > floor_of(module)]


def module_files() -> dict[str, pathlib.Path]:
    """Each module of the package, by its name (unique across the wings), and its file; a wing's __init__ (its
    face: a docstring) is not a module of the house."""
    paths = [path for path in PACKAGE.rglob("*.py") if path.parent == PACKAGE or path.name != "__init__.py"]
    files = {path.stem: path for path in paths}
    assert len(files) == len(paths), "two modules of one name"
    return files


def imported_modules(path: pathlib.Path, node: ast.ImportFrom, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules an import names: `from ..training import plan` and `from ..training.plan import x`
    alike (relative or absolute)."""
    if node.level:
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)[:-node.level]
        dotted = ".".join(parts + ([node.module] if node.module else []))
    else:
        dotted = node.module or ""
    if not dotted.startswith("lowmem_aitextgen"):
        return set()
    target = PACKAGE.parent.joinpath(*dotted.split("."))
    if target.with_suffix(".py").is_file():
        return {target.name}
    return {alias.name for alias in node.names if alias.name in modules and modules[alias.name].parent == target}


def package_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                imported |= imported_modules(path, node, modules)
        graph[name] = imported - {name}
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
    for path in PACKAGE.rglob("*.py"):
        imported = {alias.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(node, ast.ImportFrom)}
        assert not any(name.split(".")[0] == "unittest" for name in imported), path.name


# What users import, as aitextgen 0.6 and our documents name it: each keeps its path whatever folder holds the code
DOCUMENTED = {
    "lowmem_aitextgen": ("aitextgen", "TokenDataset", "merge_datasets", "train_tokenizer", "estimate_memory",
                         "MemoryEstimate"),
    "lowmem_aitextgen.aitextgen": ("aitextgen",),
    "lowmem_aitextgen.TokenDataset": ("TokenDataset", "merge_datasets"),
    "lowmem_aitextgen.tokenizers": ("train_tokenizer",),
    "lowmem_aitextgen.utils": ("GPT2ConfigCPU", "GPTNeoConfigCPU", "build_gpt2_config", "reset_seed"),
    "lowmem_aitextgen.colab": ("mount_gdrive", "copy_file_to_gdrive", "copy_file_from_gdrive", "create_gdrive_folder"),
    "lowmem_aitextgen.train": ("ATGProgressBar", "ATGTransformer"),
    "lowmem_aitextgen.cli": ("main",),
}


def test_the_documented_import_paths_import_as_before():
    for module, names in DOCUMENTED.items():
        imported = importlib.import_module(module)
        assert all(hasattr(imported, name) for name in names), (module, [n for n in names if not hasattr(imported, n)])
    assert importlib.import_module("lowmem_aitextgen.cli").__file__.endswith("lowmem_aitextgen/cli.py")


def test_each_wing_holds_its_floors():
    """training/, generation/, native/ and serving/ each hold the floors named for them (WINGS), so that a module's
    folder tells its floor's neighbourhood; the wings' imports run down the floors as every module's do."""
    for name, path in module_files().items():
        wing = "" if path.parent == PACKAGE else path.relative_to(PACKAGE).parts[0]
        assert wing in WINGS and FLOORS_OF[name] in WINGS[wing], (name, wing, FLOORS_OF[name])
    assert {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"} == \
        set(WINGS) - {""}


FLOORS_OF = {module: floor for floor, modules in FLOORS.items() for module in modules}
