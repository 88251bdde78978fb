"""The package's imports run one way: from the entry points' layer down to the formats (docs/design.md "Package
layout"), with no cycle among the modules and no project import hidden inside a function."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sparse_llm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """Project modules named by the import statements among `tree`'s direct children (a package import counts)."""
    found = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def _graph() -> dict[str, set[str]]:
    trees = {_module_name(p): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}
    return {name: _imports(tree, set(trees)) - {name} for name, tree in trees.items()}


# From the entry points' side down; a module imports only from its own layer or the layers below it.
LAYERS = (
    ("sparse_llm.cli",),
    ("sparse_llm.training", "sparse_llm.evaluation", "sparse_llm.generation", "sparse_llm.bench", "sparse_llm.doctor"),
    ("sparse_llm.data", "sparse_llm.telemetry"),
    ("sparse_llm.model",),
    ("sparse_llm.ffn.registry", "sparse_llm.ffn.dispatch", "sparse_llm.ffn.mlp", "sparse_llm.ffn.kernel_set"),
    ("sparse_llm.ffn.twell",),
    (
        "sparse_llm.ffn.backend",
        "sparse_llm.ffn.torch_backend",
        "sparse_llm.ffn.trials",
        "sparse_llm.ffn.step_scope",
        "sparse_llm.ffn.kernel_choice",
    ),
    ("sparse_llm.cuda",),
    ("sparse_llm.formats",),
    ("sparse_llm.checks",),
)


def _layer(module: str) -> int | None:
    for depth, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return depth
    return None  # a package's empty __init__


def test_every_module_has_a_layer_and_imports_only_downward():
    graph = _graph()
    unplaced = [name for name in graph if _layer(name) is None and graph[name]]
    assert not unplaced, f"modules with imports but no layer in LAYERS: {unplaced}"
    upward = [f"{name} -> {dep}" for name, deps in graph.items() for dep in deps if _layer(dep) < _layer(name)]
    assert not upward, f"imports against the layers: {upward}"


def test_no_import_cycle_among_the_package_modules():
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "import cycle: " + " -> ".join(path[path.index(name) :] + [name])
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, path + [name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_no_project_import_inside_a_function():
    hidden = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("sparse_llm"):
                        hidden.append(f"{path.relative_to(PACKAGE.parent)}:{inner.lineno}")
    assert not hidden, f"project imports inside functions (move them to the module top): {hidden}"
