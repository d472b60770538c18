"""The tree is the architecture: layers, no cycles, `stages/` = the DVC stages, DVC deps that cover the code.

Layers point one way: ``model`` ← ``sdforge`` ← ``stages`` ← ``flows`` ← ``tools`` (and ``bench``); nothing
but the tests imports ``tools`` or ``bench``, and nothing imports ``tests``. A stage's ``deps`` in
``dvc.yaml`` must cover every project module its module imports, directly or not, so that editing
one re-runs the stage (a cached output that no longer matches the code is a silent bug).
Imports are read with :mod:`ast` (no project code runs); ``if TYPE_CHECKING:`` imports are ignored.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"model": 0, "sdforge": 1, "stages": 2, "flows": 3, "tools": 4, "bench": 4}
"""A module may import its own layer and the layers below it."""
LAYER_ORDER = "model ← sdforge ← stages ← flows ← tools, bench"
ONLY_TESTS_IMPORT = {"tools", "bench"}
MAX_STAGE_LINES = 200
MAX_FUNCTION_LINES = 60

# Project modules a stage may import without listing them in its dvc.yaml deps, because they cannot
# change what the stage writes to its outputs. Keep this short; every entry says why.
DEPS_ALLOWLIST = {
    "sdforge.tracking",  # logs params/metrics/artifacts to MLflow; writes nothing under the stage's outs
    "sdforge.tracking_spool",  # MLflow records spooled beside the SQLite store; nothing under the stage's outs
    # The typed view of params.yaml. DVC tracks the values a stage reads through its `params:` list, so
    # a new field re-runs nothing while its default keeps today's behaviour; a change of behaviour must come
    # with an explicit value in params.yaml (docs/ARCHITECTURE.md). Listing it would re-run the whole
    # DAG at full scale for every new option. A package: every module of it (sdforge.config.*) is allowlisted.
    "sdforge.config",
    # logging set-up, the stage CLI wrapper, atomic writes of bytes the stage computed, and file-name conventions
    # (metrics_path, held_out_path) whose files are the stages' own dvc.yaml outs and deps
    "sdforge.io",
    # checks on folders a command may replace, and the move aside of what a stage did not write: it changes no
    # byte of a stage's outputs (listing it would re-run fetch_images and train at full scale)
    "sdforge.output_dirs",
    # filters known library log messages by text (imported by every entry package's __init__): no output byte
    "sdforge.library_logs",
    "sdforge",
    "stages",  # the stages package's __init__: its docstring and `import sdforge` (the filter above)
}
STAGE_DEPS_ALLOWLIST = {
    # Validation images: sampled from the EMA weights (swapped in and back out) and logged to MLflow only;
    # tests/stages/test_train.py checks that training is bit-identical with and without them.
    "train": {"sdforge.eval.grid", "sdforge.eval.sampling", "sdforge.demo.shapes"},
    # The demo captioner's module also scores captions (caption_accuracy: bench.demo_captioner) through the
    # captioning package, and the stage takes the captioner's folder name from it; training the captioner
    # (what prepare_models writes) uses none of it.
    "prepare_models": {"sdforge.captions.captioner", "sdforge.captions.cache", "sdforge.captions.models",
                       "sdforge.captions.quality"},
    # Imported with sdforge.latents (the encoder's image-to-tensor scaling); a condition is the Canny map of the decoded
    # crop, which that module never touches.
    "condition_images": {"model.latents"},
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    lazy: bool  # inside a function


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every project module (the layered packages and the tests) by dotted name."""
    found = {}
    for top in [*LAYERS, "tests"]:
        for path in sorted((REPO / top).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _resolve(name: str) -> str | None:
    """The project module ``name`` refers to (itself or its longest known parent), None if third-party."""
    if name.split(".")[0] not in modules() and name.split(".")[0] not in (*LAYERS, "tests"):
        return None
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST, in_function: bool = False):
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        yield from _walk(child, inner)


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """The project modules ``module`` imports at run time (top-level and inside functions)."""
    tree = ast.parse(modules()[module].read_text())
    found = []
    for node, lazy in _walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.level:
            raise AssertionError(f"{module}:{node.lineno}: relative import; use the absolute module path")
        else:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.append(Import(module, target, node.lineno, lazy))
    return tuple(found)


def _layer(module: str) -> int | None:
    return LAYERS.get(module.split(".")[0])


def _non_test_modules() -> list[str]:
    return [m for m in modules() if not m.startswith("tests")]


def layer_violations() -> list[str]:
    """Imports that point up a layer, into ``tests``, or into ``tools``/``bench`` from outside them."""
    bad = []
    for module in _non_test_modules():
        top = module.split(".")[0]
        for imp in imports_of(module):
            target_top = imp.target.split(".")[0]
            where = f"{modules()[module].relative_to(REPO)}:{imp.line}: {module} imports {imp.target}"
            if target_top == "tests":
                bad.append(f"{where} (nothing imports the tests; shared builders belong in the package)")
            elif target_top in ONLY_TESTS_IMPORT and target_top != top:
                bad.append(f"{where} ({target_top}/ is an operator folder that nothing else imports)")
            elif _layer(imp.target) > _layer(module):
                bad.append(f"{where} (a lower layer imports a higher one: {LAYER_ORDER})")
    return bad


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over run-time imports."""
    graph = {m: sorted({i.target for i in imports_of(m)}) for m in _non_test_modules()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def dvc_stages() -> dict[str, dict]:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def stage_deps(stage: dict) -> list[str]:
    body = stage.get("do", stage)
    return [d if isinstance(d, str) else next(iter(d)) for d in body.get("deps", []) if "${" not in str(d)]


def import_closure(module: str) -> set[str]:
    """``module`` and every project module it imports transitively, with the packages they sit in."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += [i.target for i in imports_of(current)]
        parts = current.split(".")
        todo += [".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) in modules()]
    return seen


def _empty(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def allowlisted(module: str, stage: str) -> bool:
    """Whether stage ``stage`` may import ``module`` unlisted: it, or a package it sits in, is allowlisted."""
    allowed = DEPS_ALLOWLIST | STAGE_DEPS_ALLOWLIST.get(stage, set())
    return any(module == entry or module.startswith(entry + ".") for entry in allowed)


def uncovered_modules(name: str, stage: dict) -> list[str]:
    """Project modules that stage ``name`` imports but that none of its dvc.yaml deps covers."""
    deps = [d.rstrip("/") for d in stage_deps(stage)]
    missing = []
    for module in sorted(import_closure(f"stages.{name}")):
        path = str(modules()[module].relative_to(REPO))
        if allowlisted(module, name) or _empty(modules()[module]):
            continue
        if not any(path == d or path.startswith(d + "/") for d in deps):
            missing.append(path)
    return missing


# ------------------------------------------------------------------------------------------ tests
def test_stages_folder_holds_exactly_the_dvc_stages():
    on_disk = {p.stem for p in (REPO / "stages").iterdir() if p.name != "__init__.py" and p.name != "__pycache__"}
    assert on_disk == set(dvc_stages()), (
        f"only in stages/: {sorted(on_disk - set(dvc_stages()))} (library code belongs in sdforge/); "
        f"only in dvc.yaml: {sorted(set(dvc_stages()) - on_disk)}"
    )


def test_each_stage_runs_its_own_module():
    for name, stage in dvc_stages().items():
        cmd = stage.get("do", stage)["cmd"]
        assert f"python -m stages.{name} " in cmd, f"dvc.yaml stage {name}: cmd runs another module"


def test_stage_deps_cover_every_module_the_stage_imports():
    missing = {name: m for name, stage in dvc_stages().items() if (m := uncovered_modules(name, stage))}
    assert not missing, (
        "dvc.yaml deps miss modules that can change these stages' outputs (add their folder to the stage's deps, "
        f"or, if they cannot change outputs, to DEPS_ALLOWLIST with the reason): {missing}"
    )


def test_stage_deps_exist():
    for name, stage in dvc_stages().items():
        for dep in stage_deps(stage):
            assert (REPO / dep).exists(), f"dvc.yaml stage {name}: dep {dep} does not exist"


def test_layers_point_one_way():
    assert not layer_violations(), "\n".join(layer_violations())


def imports_between(importer_prefix: str, allowed) -> list[Import]:
    """Imports by modules under ``importer_prefix`` of project modules under it that ``allowed`` refuses."""
    return [
        imp
        for m in modules()
        if m.startswith(importer_prefix)
        for imp in imports_of(m)
        if imp.target.startswith(importer_prefix) and not allowed(imp.target)
    ]


def test_stages_do_not_import_each_other():
    bad = [
        f"{i.importer} imports {i.target} (move what both need into sdforge/)"
        for i in imports_between("stages.", allowed=lambda target: False)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    assert not cycles(), f"import cycles: {cycles()}"


LAZY_COMMAND_IMPORTS = {
    # The `sdforge` console entry: `sdforge --help` and a refused flag answer in < 1 s (issue 55), so each command
    # imports the project module it runs (torch, diffusers, MLflow under it: ~8 s) inside itself, with a reason.
    "tools.cli",
}


def test_project_imports_sit_at_the_top_of_the_file():
    lazy = [
        f"{modules()[i.importer].relative_to(REPO)}:{i.line}: {i.target}"
        for m in _non_test_modules()
        if m not in LAZY_COMMAND_IMPORTS
        for i in imports_of(m)
        if i.lazy
    ]
    assert not lazy, "project imports inside functions (move them to the top of the file):\n" + "\n".join(lazy)


def test_stage_modules_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "stages").glob("*.py")}
    long = {name: n for name, n in sizes.items() if n > MAX_STAGE_LINES}
    assert not long, f"stage modules over {MAX_STAGE_LINES} lines (move library code into sdforge/): {long}"


MAX_TRAINING_LINES, MAX_TRAIN_STAGE_LINES, MAX_LOOP_LINES = 300, 100, 50
"""Issue 37: the training package by component, its stage thin, the loop on one screen."""


def test_training_stays_in_components_and_the_loop_on_one_screen():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "sdforge/training").glob("*.py")}
    long = {name: n for name, n in sizes.items() if n > MAX_TRAINING_LINES}
    assert not long, f"sdforge/training modules over {MAX_TRAINING_LINES} lines (split by component): {long}"
    assert len((REPO / "stages/train.py").read_text().splitlines()) <= MAX_TRAIN_STAGE_LINES
    tree = ast.parse((REPO / "sdforge/training/loop.py").read_text())
    (loop,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_loop"]
    assert loop.end_lineno - loop.lineno + 1 <= MAX_LOOP_LINES


def test_functions_stay_short():
    long = []
    for module in [m for m in _non_test_modules() if not m.startswith("bench")]:  # benchmark mains: a script each
        for node in ast.walk(ast.parse(modules()[module].read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{modules()[module].relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_tests_share_builders_through_fixtures_only():
    def shared(target: str) -> bool:
        return target.startswith("tests.fixtures") or target.endswith(".conftest")

    bad = [
        f"{modules()[i.importer].relative_to(REPO)}:{i.line}: imports {i.target} (share via tests/fixtures/)"
        for i in imports_between("tests.", shared)
    ]
    assert not bad, "\n".join(bad)


def lazy_imports_without_reason() -> list[str]:
    """Imports inside functions (third-party ones: project ones must sit at the top) with no comment saying why."""
    found = []
    for module in [m for m in _non_test_modules() if not m.startswith("bench")]:  # a benchmark's child chooses
        path = modules()[module]  # what it imports, and when, as part of what it measures
        lines = path.read_text().splitlines()
        for node, lazy in _walk(ast.parse(path.read_text())):
            if lazy and not _has_reason(lines, node.lineno - 1):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def _has_reason(lines: list[str], index: int) -> bool:
    """A comment on the import's line, or above the block of imports (and set-up calls) it belongs to."""
    if "#" in lines[index]:
        return True
    while index > 0 and lines[index - 1].strip() and not lines[index - 1].strip().startswith("#"):
        index -= 1
        if lines[index].rstrip().endswith(":"):  # reached the enclosing def/if: no comment above the block
            return False
    return index > 0 and lines[index - 1].strip().startswith("#")


FAMILY_CLASSES = ("UNet2DConditionModel", "SD3Transformer2DModel")
"""The denoiser families' model classes: only ``model/denoisers/`` names them (issue 56: the seam)."""


def test_only_the_family_modules_name_the_denoiser_classes():
    named = [
        f"{path.relative_to(REPO)}: {cls}"
        for path in sorted(REPO.glob("*/**/*.py"))
        if path.parts[len(REPO.parts)] in ("model", "sdforge", "stages", "flows", "tools", "bench")
        and "denoisers" not in path.relative_to(REPO).parts
        for cls in FAMILY_CLASSES
        if cls in path.read_text()
    ]
    assert not named, "only model/denoisers/ may name a family's model class; ask the family instead:\n" + "\n".join(
        named
    )


def test_lazy_imports_say_why():
    assert not lazy_imports_without_reason(), (
        "imports inside functions need a one-line reason (a comment on the line or above it), "
        "or belong at the top of the file:\n" + "\n".join(lazy_imports_without_reason())
    )


def test_the_train_stage_fingerprints_what_dvc_yaml_gives_it():
    """The run dir's input fingerprint (sdforge/training/inputs.py) hashes exactly the train stage's data deps and
    params in dvc.yaml: an input DVC tracks but the fingerprint ignores would resume a run over changed inputs
    (issue 37: a new text encoder re-exported the old weights); code deps are covered by the import check above."""
    from sdforge.training.inputs import INPUT_FILES, INPUT_PARAMS

    stage = dvc_stages()["train"]["do"]
    assert {d for d in stage["deps"] if d.startswith("${")} == set(INPUT_FILES.values())
    assert set(stage["params"]) == set(INPUT_PARAMS)
