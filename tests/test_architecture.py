"""The code's shape, read from the source (no import of the package): no import cycles between modules, engine
names compared only by the registry and the config, device meshes and process groups made in one module, short
functions and a short loop. Each test names what it found, so a failure says where to look."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SOURCE / "pretrainer"


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports anywhere in its file (functions included: a lazy import
    closes a cycle as surely as one at the top)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_only:  # `if TYPE_CHECKING:` imports never run
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from .x import y`: y may be a module of its own (from . import checkpoint)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        targets |= {name for name in names if name in modules and name != module}
    return targets


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_reader_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    graph = _import_graph()
    assert len(graph) > 100 and graph["pretrainer.train.trainer"], "the reader found no modules or imports"
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def _source_files(*exclude: str) -> dict[str, str]:
    """{path relative to the package: text} of every module but those under `exclude`."""
    return {path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(PACKAGE.rglob("*.py"))
            if not any(path.relative_to(PACKAGE).as_posix().startswith(prefix) for prefix in exclude)}


def _matches(pattern: str, *exclude: str) -> list[str]:
    regex = re.compile(pattern)
    return [f"{name}:{number}: {line.strip()}" for name, text in _source_files(*exclude).items()
            for number, line in enumerate(text.splitlines(), 1) if regex.search(line)]


ENGINE_NAMES = "single|ddp|fsdp|deepspeed|megatron"


def test_engine_names_are_compared_only_by_the_registry_and_the_config():
    """Which engines exist, and what each can do, is read from parallel/registry.py and the engine classes: no
    `name == "fsdp"`, `in ("ddp", ...)` or `.name != "megatron"` anywhere else."""
    compared = rf"""(==|!=|\bin|\bis)\s*[(\[{{]?\s*["']({ENGINE_NAMES})["']|["']({ENGINE_NAMES})["']\s*(==|!=)"""
    found = _matches(compared, "config/", "parallel/registry.py")
    assert not found, "engine names compared outside the registry:\n" + "\n".join(found)
    samples = ['if name == "fsdp":', "if engine in ('ddp', 'fsdp'):", 'ok = "megatron" != name', 'name = "fsdp"']
    assert [bool(re.search(compared, s)) for s in samples] == [True, True, True, False]


def test_no_engine_class_is_also_the_planners_cost_model():
    """Each engine's cost model is a class of its own, registered beside it; the engine inherits only the traits the
    cost model reads its dimensions from."""
    from pretrainer.parallel import ENGINES
    from pretrainer.parallel.layout import CostModel

    for entry in ENGINES:
        assert not issubclass(entry.cls, CostModel), entry.name
        assert issubclass(entry.costs, CostModel) and issubclass(entry.cls, entry.costs.traits), entry.name
        planner = {name for name in vars(CostModel) if not name.startswith("_") and name != "traits"}
        assert not planner & set(dir(entry.cls)), (entry.name, planner & set(dir(entry.cls)))


def test_meshes_and_process_groups_are_made_in_one_module():
    made = r"\b(init_device_mesh|new_group|DeviceMesh)\s*\("
    found = _matches(made, "parallel/meshes.py")
    assert not found, "meshes or groups made outside parallel/meshes.py:\n" + "\n".join(found)
    assert _matches(made), "the pattern no longer finds parallel/meshes.py's own"


def _long_functions(limit: int) -> list[str]:
    long = []
    for name, text in _source_files().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    long.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    return long


def test_no_function_over_60_lines():
    long = _long_functions(60)
    assert not long, "functions over 60 lines (split them by job):\n" + "\n".join(long)
    assert _long_functions(30), "the reader found no function at all"


def test_the_training_loop_module_stays_short():
    lines = len((PACKAGE / "train" / "trainer.py").read_text(encoding="utf-8").splitlines())
    assert lines <= 350, f"train/trainer.py has {lines} lines: the loop delegates (checkpointer, validator, hooks)"
