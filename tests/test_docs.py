"""The documentation names only what exists: every file, module and link in README.md, MIGRATING.md and docs/
is in the tree, and every `lowmem_aitextgen ...` command shown names a verb and flags the command knows."""

import inspect
import pathlib
import re
import shlex

import pytest

from lowmem_aitextgen import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (not benchmarks/HISTORY.md: a log of what was measured names modules since removed)
DOCUMENTS = [ROOT / "README.md", ROOT / "MIGRATING.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "benchmarks" / "RESULTS.md"]
# where a bare file name (`plan.py`) may live
HOMES = ("", "lowmem_aitextgen", "lowmem_aitextgen/training", "lowmem_aitextgen/generation",
         "lowmem_aitextgen/serving", "lowmem_aitextgen/native", "lowmem_aitextgen/native/csrc", "tests", "benchmarks",
         "benchmarks/results", "samples", "docs")
# names the documents use for the user's own files, not this tree's
USERS_FILES = {"your_script.py", "data.txt", "input.txt", "train.py"}
PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md|sh|jsonl|cfg|ini|toml))(?![\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
COMMAND = re.compile(r"lowmem_aitextgen ((?:encode|train_tokenizer|train|generate|estimate|serve)(?![\w/])[^`\n]*)")


def test_the_front_door_is_one_page_and_the_manual_is_in_docs():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150
    assert {"memory.md", "runs.md", "scaling.md", "cli.md", "architecture.md"} <= {p.name for p in DOCUMENTS}


def referenced_files(document: pathlib.Path) -> set[str]:
    text = document.read_text(encoding="utf-8")
    names = {match for match in PATH.findall(text) if "://" not in match}
    return names | {link for link in LINK.findall(text) if "://" not in link}


def exists(name: str, document: pathlib.Path) -> bool:
    if name in USERS_FILES or name.startswith("aitextgen/"):  # aitextgen 0.6.0's own files
        return True
    candidates = [document.parent / name] + [ROOT / home / name for home in HOMES]
    return any(candidate.exists() for candidate in candidates)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_file_module_and_link_named_exists(document):
    missing = sorted(name for name in referenced_files(document) if not exists(name, document))
    assert not missing, f"{document.name} names files that do not exist: {missing}"


def test_the_reader_finds_what_it_should():
    """The reader is not vacuous: it sees the names in backticks, paths and links, and misses a wrong one."""
    readme = ROOT / "README.md"
    found = referenced_files(readme)
    assert {"MIGRATING.md", "docs/memory.md", "samples/train_small_gpt2.py"} <= found
    assert not exists("cpu_speed.py", readme) and exists("cpu.py", readme)


def shown_commands() -> list[str]:
    return [command.strip() for document in DOCUMENTS
            for command in COMMAND.findall(document.read_text(encoding="utf-8"))]


def test_every_command_shown_parses():
    commands = shown_commands()
    assert len(commands) >= 6
    for command in commands:
        verb, *argv = shlex.split(command)
        assert verb in cli.COMMANDS, command
        try:
            cli.checked_argv(verb, argv)
        except SystemExit:
            pytest.fail(f"the documented command `lowmem_aitextgen {command}` does not parse")


@pytest.mark.parametrize("function", ["aitextgen", "train", "generate", "estimate_memory"])
def test_each_public_entry_point_documents_every_argument_in_its_args_section(function):
    from lowmem_aitextgen import aitextgen, estimate_memory

    target = {"aitextgen": aitextgen.__init__, "train": aitextgen.train, "generate": aitextgen.generate,
              "estimate_memory": estimate_memory}[function]
    doc = inspect.getdoc(aitextgen if function == "aitextgen" else target)
    args = doc.split("Args:", 1)[1]
    named = {name for line in args.splitlines() if re.match(r"\s{4}\S", line)
             for name in re.findall(r"\*{0,2}(\w+)", line.split(":", 1)[0])}
    parameters = {("**" if p.kind is p.VAR_KEYWORD else "") + name
                  for name, p in inspect.signature(target).parameters.items() if name != "self"}
    missing = {p.lstrip("*") for p in parameters} - named - ({"kwargs"} if function == "aitextgen" else set())
    assert not missing, missing


def test_the_serve_pages_flag_defaults_are_the_commands_and_its_settings():
    """docs/serve.md's flag table states serve's defaults: each is `lowmem_aitextgen serve`'s (cli.serve_cli),
    which are ServeSettings' too."""
    import dataclasses

    from lowmem_aitextgen.serving.serving import ServeSettings

    signature = inspect.signature(cli.serve_cli).parameters
    settings = {field.name: field.default for field in dataclasses.fields(ServeSettings)}
    checked = 0
    for line in (ROOT / "docs" / "serve.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `--"):
            continue
        flags, defaults = re.findall(r"`--(\w+)`", line.split("|")[1]), line.split("|")[2].split(",")
        assert len(flags) == len(defaults), line
        for flag, stated in zip(flags, (d.strip().strip("`") for d in defaults)):
            default = signature[flag].default
            assert stated == ("none" if default is None else str(default).removesuffix(".0")), (flag, stated)
            assert settings[flag] == default, flag
            checked += 1
    assert checked == len(settings)


def test_the_completions_tables_fields_and_defaults_are_what_the_parser_does():
    """completions.py's table: its fields are the ones the parser knows, and a request giving a field at the
    default the table states is read as one leaving it out."""
    import dataclasses
    import json

    from lowmem_aitextgen.serving import completions

    rows = [line.split("|")[1:4] for line in completions.__doc__.splitlines()
            if line.startswith("| ") and not line.startswith("| field")]
    stated = {name.strip(): default.strip() for name, _, default in rows}
    assert set(stated) == completions.KNOWN

    def read(**fields) -> dict:
        request = completions.parse(json.dumps({"model": "m", **fields}).encode(), completions.Limits("m", 1024))
        return {k: v for k, v in dataclasses.asdict(request).items() if k not in ("id", "created")}

    checked = 0
    for name, default in stated.items():
        if default != "-":  # the model has none: it is required
            assert read(**{name: None if default == "none" else json.loads(default)}) == read(), (name, default)
            checked += 1
    assert checked == len(stated) - 1


def test_the_results_page_holds_a_dated_current_table_for_each_kind_of_cpu_and_the_history_none():
    """benchmarks/RESULTS.md: training and generation, each on a native-bf16 and an AVX2-only CPU, dated (or said
    to be unmeasured), and nothing else but current sections, a page a user reads; benchmarks/HISTORY.md, the
    sessions' log, calls nothing current."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.*)$", text, flags=re.MULTILINE)
    current = [h.removeprefix("Current: ") for h in headings if h.startswith("Current: ")]
    for work in ("training", "generation"):
        for cpu in ("a CPU with native bf16", "an AVX2-only CPU"):
            heading = next((h for h in current if h.startswith(f"{work} on {cpu}")), None)
            assert heading is not None, f"no current {work} table on {cpu}"
            assert re.search(r"\d{4}-\d{2}-\d{2}", heading) or "not measured" in heading, heading
    assert set(headings) - {f"Current: {h}" for h in current} <= {"How training is measured"}
    assert len(text.splitlines()) <= 500
    history = (ROOT / "benchmarks" / "HISTORY.md").read_text(encoding="utf-8")
    assert not re.search(r"^## Current", history, flags=re.MULTILINE)