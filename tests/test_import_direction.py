"""DESIGN.md's import rules, checked on the source (ast) and, for torch, in a fresh process.

Imports run down the picture only: api → engine → scheduler → kv_cache, engine → executor
→ worker → models → kernels, with `distributed` (the tensor-parallel group) below the
worker and the models; `chat` (conversations to prompt text, tool-call formats) below the
engine, for the server's chat and the offline `LLM.chat` alike. Every layer may import the
leaf modules; leaves import only leaves; kernels import
nothing of serve but config; nothing imports serve.api. `bench` (the load tool) imports
nothing of serve but itself: it speaks HTTP to any server. The scheduler, chat, the block
allocator and the leaves import no torch, not even inside a function, and not through another module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO_ROOT / "serve"

LEAVES = frozenset(
    {
        "config",
        "sampling_params",
        "structured_outputs",
        "pooling_params",
        "sequence",
        "outputs",
        "step",
        "vllm_arguments",
        "lora_request",
        "multimodal_inputs",
        "process_exit",
    }
)
LAYERS = frozenset(
    {"api", "engine", "scheduler", "kv_cache", "executor", "worker", "models", "distributed"}
    | {"kernels", "bench", "chat"}
)
ROOT = "root"  # serve/__init__.py, and `from serve import Name` re-exports
EVERYTHING = LAYERS | LEAVES | {ROOT}

# Which groups (a layer, a leaf module, or the root package) each group may import.
ALLOWED_IMPORTS = {
    "api": EVERYTHING,
    "engine": {"engine", "scheduler", "kv_cache", "executor", "worker", "models", "kernels"}
    | {"chat"}
    | LEAVES,
    "chat": {"chat"} | LEAVES,
    "scheduler": {"scheduler", "kv_cache"} | LEAVES,
    "kv_cache": {"kv_cache"} | LEAVES,
    "executor": {"executor", "worker", "distributed"} | LEAVES,
    "worker": {"worker", "kv_cache", "models", "distributed", "kernels"} | LEAVES,
    "models": {"models", "distributed", "kernels"} | LEAVES,
    "distributed": {"distributed"} | LEAVES,
    "kernels": {"kernels", "config"},
    "bench": {"bench"},
    ROOT: EVERYTHING - {"api"},
    **{leaf: LEAVES for leaf in LEAVES},
}

TORCH_MODULES = ("torch", "triton")
TORCH_FREE_KV_CACHE = {"block_pool", "block_manager", "prefix_cache"}


@dataclass(frozen=True)
class Import:
    target: str  # absolute module name: "serve.kv_cache.block_manager", "torch.nn", ...
    line: int
    is_eager: bool  # runs when the module is imported: not in a function, not TYPE_CHECKING


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def serve_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def group_of(module: str) -> str | None:
    """The layer or leaf that owns `module`; None when DESIGN.md's map lacks it."""
    parts = module.split(".")
    if parts == ["serve"]:
        return ROOT
    if parts == ["serve", "__main__"]:
        return "api"  # `python -m serve`: the command line, as serve.api.cli
    return parts[1] if parts[1] in LAYERS | LEAVES else None


def is_torch_free(module: str) -> bool:
    parts = module.split(".")
    if len(parts) < 2:
        return False
    if parts[1] in ("scheduler", "chat") or parts[1] in LEAVES:
        return True
    return parts[1] == "kv_cache" and len(parts) > 2 and parts[2] in TORCH_FREE_KV_CACHE


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _from_targets(base: str, names: list[str]) -> list[str]:
    """`from base import name`: the submodule when `name` is one, else `base` itself."""
    if base.split(".")[0] != "serve":
        return [base]
    targets = []
    for name in names:
        candidate = f"{base}.{name}"
        is_submodule = candidate in serve_modules() or (
            base == "serve" and name in LAYERS | LEAVES  # a module not written yet
        )
        targets.append(candidate if is_submodule else base)
    return targets


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    path = serve_modules()[module]
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, is_eager: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, is_eager) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            for target in dict.fromkeys(_from_targets(base, [a.name for a in node.names])):
                found.append(Import(target, node.lineno, is_eager))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(node.args[0].value, node.lineno, is_eager))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            is_eager = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, is_eager)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, is_eager)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return tuple(found)


def _where(module: str, line: int) -> str:
    return f"{serve_modules()[module].relative_to(REPO_ROOT)}:{line}"


def _is_torch(target: str) -> bool:
    return target.split(".")[0] in TORCH_MODULES


def _modules_run_by_import(target: str) -> list[str]:
    """`import serve.a.b` runs serve/__init__.py, serve/a/__init__.py and serve/a/b.py."""
    parts = target.split(".")
    return [m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in serve_modules()]


def _eager_torch_chain(start: str) -> list[str] | None:
    """A chain of eager imports from `start` to a module that imports torch eagerly."""
    queue = _modules_run_by_import(start)
    parents = dict.fromkeys(queue)
    while queue:
        module = queue.pop(0)
        for imp in imports_of(module):
            if not imp.is_eager:
                continue
            if _is_torch(imp.target):
                chain = [f"{_where(module, imp.line)} imports {imp.target}"]
                while parents[module] is not None:
                    module, via = parents[module]
                    chain.append(f"{_where(module, via.line)} imports {via.target}")
                return chain[::-1]
            for next_module in _modules_run_by_import(imp.target):
                if next_module not in parents:
                    parents[next_module] = (module, imp)
                    queue.append(next_module)
    return None


def test_every_module_is_on_the_map():
    unknown = [
        f"{path.relative_to(REPO_ROOT)}: not in DESIGN.md's module map (add it there and here)"
        for module, path in serve_modules().items()
        if group_of(module) is None
    ]
    assert not unknown, "\n".join(unknown)


def test_imports_run_down_the_layers():
    violations = []
    for module in serve_modules():
        source_group = group_of(module)
        if source_group is None:
            continue  # reported by test_every_module_is_on_the_map
        for imp in imports_of(module):
            if imp.target.split(".")[0] != "serve":
                continue
            target_group = group_of(imp.target)
            if target_group in ALLOWED_IMPORTS[source_group]:
                continue
            if target_group is None:
                rule = f"{imp.target} is not in DESIGN.md's module map"
            elif target_group == "api":
                rule = "nothing outside serve.api imports serve.api"
            elif target_group == ROOT:
                rule = "import from the defining module, not the `serve` package root"
            else:
                allowed = ", ".join(sorted(ALLOWED_IMPORTS[source_group]))
                rule = f"{source_group} may import only: {allowed}"
            violations.append(f"{_where(module, imp.line)}: imports {imp.target} — {rule}")
    assert not violations, "imports against DESIGN.md's direction:\n" + "\n".join(violations)


def test_scheduler_allocator_and_leaves_import_no_torch():
    violations = []
    for module in serve_modules():
        if not is_torch_free(module):
            continue
        direct = [imp for imp in imports_of(module) if _is_torch(imp.target)]
        for imp in direct:
            violations.append(
                f"{_where(module, imp.line)}: imports {imp.target} — "
                "the scheduler, the block allocator and the leaf modules import no torch"
            )
        if not direct and (chain := _eager_torch_chain(module)):
            violations.append(
                f"{serve_modules()[module].relative_to(REPO_ROOT)}: loads torch when imported, "
                "via " + " -> ".join(chain)
            )
    assert not violations, "torch where DESIGN.md says none:\n" + "\n".join(violations)


TORCH_FREE_AT_RUNTIME = [
    "serve",
    "serve.config",
    "serve.vllm_arguments",
    "serve.sampling_params",
    "serve.structured_outputs",
    "serve.sequence",
    "serve.outputs",
    "serve.step",
    "serve.scheduler.scheduler",
    "serve.kv_cache.block_pool",
    "serve.kv_cache.block_manager",
    "serve.chat.rendering",
    # The API process imports these before it spawns the engine core: the core's seconds
    # of torch, transformers and the model's modules load in the core alone, while the API
    # process imports its own (core_client.py).
    "serve.engine.core_client",
    "serve.engine.core_process",
]

_PROBE = """
import importlib, sys
importlib.import_module(sys.argv[1])
loaded = sorted(m for m in sys.modules if m in {names!r})
print(" ".join(loaded))
sys.exit(1 if loaded else 0)
"""


def _assert_import_loads_none(module: str, names: set[str]) -> None:
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(names=names), module],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, (
        f"`import {module}` loaded {result.stdout.strip() or '(import failed)'}\n{result.stderr}"
    )


@pytest.mark.parametrize("module", TORCH_FREE_AT_RUNTIME)
def test_importing_loads_no_torch(module):
    if module not in serve_modules():
        pytest.skip(f"{module} is not written yet")
    _assert_import_loads_none(module, set(TORCH_MODULES))


def test_the_engine_imports_no_xgrammar_before_a_grammar():
    """xgrammar (~0.6 s) loads with the first grammar, not with every core and rank."""
    _assert_import_loads_none("serve.engine.core", {"xgrammar"})
