"""The package's imports point one way, as ARCHITECTURE.md draws them (read with ``ast``; nothing is imported).

Every ``import`` / ``from ... import`` of every module under ``ds_megatron/`` counts, at the top or
inside a function.  The rules, each a test below:

* no circle between modules, nor between subpackages (``config``, ``integration``, ... and the root
  modules ``errors``, ``parallel_state``, ``cli``, ``__init__``, each a node of its own);
* every arrow between subpackages is one ARCHITECTURE.md draws (its ``dependencies`` block), and
  every arrow it draws exists;
* ``deepspeed`` is imported only inside ``ds_megatron/integration/``;
* the torch-free half (ARCHITECTURE.md's ``torch-free`` block) reaches neither torch nor DeepSpeed
  through the imports that run when it is imported (the top-level ones, with the packages' ``__init__``);
* an import of our own modules inside a function sits only in a boundary module ARCHITECTURE.md
  names (its ``boundaries`` block), with a comment on its line or the line above saying why.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ds_megatron"
HEAVY = ("torch", "deepspeed")  # what the torch-free half must not load


def _module_files() -> Dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[module[:-len(".__init__")] if module.endswith(".__init__") else module] = path
    return out


MODULES = _module_files()


class Import:
    def __init__(self, target: str, line: int, in_function: bool):
        self.target, self.line, self.in_function = target, line, in_function


def _resolve(module: str, node: ast.AST) -> List[str]:
    """The modules an import statement names (``from pkg import mod`` names ``pkg.mod`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    is_package = MODULES.get(module, "").endswith("__init__.py")
    base = module if is_package else module.rpartition(".")[0]
    if node.level:
        parts = base.split(".")
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        full = f"{base}.{node.module}" if node.module else base
    else:
        full = node.module
    return [f"{full}.{alias.name}" if f"{full}.{alias.name}" in MODULES else full for alias in node.names]


def _imports(module: str) -> List[Import]:
    tree = ast.parse(open(MODULES[module]).read())
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(fn) if n is not fn)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [Import(t, node.lineno, id(node) in inside) for t in _resolve(module, node)]
    return out


IMPORTS = {m: _imports(m) for m in MODULES}


def _ours(target: str) -> str:
    """The module of ours an import target is (``ds_megatron.config.SECTION`` -> ``ds_megatron.config``), or ''."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def node_of(module: str) -> str:
    """The dependency picture's node: the subpackage, or the root module (``__init__`` for the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_edges() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = defaultdict(set)
    for module, imports in IMPORTS.items():
        for imp in imports:
            target = _ours(imp.target) if imp.target.split(".")[0] == PACKAGE else ""
            if target and target != module:
                edges[module].add(target)
    return edges


def package_edges() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = defaultdict(set)
    for module, targets in module_edges().items():
        for target in targets:
            if node_of(module) != node_of(target):
                edges[node_of(module)].add(node_of(target))
    return edges


def find_cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return cycles


def architecture_block(name: str) -> str:
    """The body of ARCHITECTURE.md's fenced block with info string ``name``."""
    text = open(os.path.join(ROOT, "ARCHITECTURE.md")).read()
    match = re.search(rf"^```{name}\n(.*?)^```", text, re.S | re.M)
    assert match, f"ARCHITECTURE.md has no ```{name} block"
    return match.group(1)


def drawn_edges() -> Dict[str, Set[str]]:
    """ARCHITECTURE.md's ``dependencies`` block: one ``node -> a, b, ...`` line per node."""
    edges: Dict[str, Set[str]] = {}
    for line in architecture_block("dependencies").splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        node, _, targets = line.partition("->")
        edges[node.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    return edges


def _listed(name: str) -> List[str]:
    """The comma- or line-separated items of a block (``#`` starts a comment)."""
    body = "\n".join(line.split("#")[0] for line in architecture_block(name).splitlines())
    return [item.strip() for item in re.split(r"[,\n]", body) if item.strip()]


def torch_free_modules() -> List[str]:
    """The modules of ARCHITECTURE.md's ``torch-free`` block (a subpackage stands for all its modules)."""
    out = []
    for item in _listed("torch-free"):
        if item == "__init__":
            found = [PACKAGE]
        else:
            name = f"{PACKAGE}.{item}"
            found = [m for m in MODULES if m == name or m.startswith(name + ".")]
        assert found, f"ARCHITECTURE.md's torch-free block names {item}, which is no module of ours"
        out += found
    return sorted(set(out))


def boundary_modules() -> Dict[str, str]:
    """ARCHITECTURE.md's ``boundaries`` block: ``module: why`` lines."""
    out = {}
    for line in architecture_block("boundaries").splitlines():
        if line.strip():
            module, _, why = line.partition(":")
            out[PACKAGE if module.strip() == "__init__" else f"{PACKAGE}.{module.strip()}"] = why.strip()
    return out


def _parents(module: str) -> List[str]:
    """The packages Python runs before ``module`` (their ``__init__``)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def runtime_closure(module: str) -> Tuple[Set[str], Dict[str, str]]:
    """What importing ``module`` runs: our modules (top-level imports, and the parent packages' ``__init__``),
    and the third-party roots they import, each with one module that imports it."""
    seen: Set[str] = set()
    external: Dict[str, str] = {}
    todo = [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += [p for p in _parents(current) if p in MODULES]
        for imp in IMPORTS[current]:
            if imp.in_function:
                continue
            if imp.target.split(".")[0] == PACKAGE:
                target = _ours(imp.target)
                if target:
                    todo.append(target)
            else:
                external.setdefault(imp.target.split(".")[0], current)
    return seen, external


# -- the tests ------------------------------------------------------------------------------------------------------

def test_no_circle_between_modules():
    assert find_cycles(module_edges()) == []


def test_no_circle_between_subpackages():
    assert find_cycles(package_edges()) == []


def test_every_arrow_between_subpackages_is_drawn_in_architecture_md():
    actual, drawn = package_edges(), drawn_edges()
    undrawn = sorted(f"{a} -> {b}" for a, bs in actual.items() for b in bs if b not in drawn.get(a, set()))
    stale = sorted(f"{a} -> {b}" for a, bs in drawn.items() for b in bs if b not in actual.get(a, set()))
    unknown = sorted(set(drawn) - {node_of(m) for m in MODULES})
    assert not undrawn, f"imports ARCHITECTURE.md's dependencies block does not draw: {undrawn}"
    assert not stale, f"arrows ARCHITECTURE.md draws that no import makes (redraw it): {stale}"
    assert not unknown, f"ARCHITECTURE.md names nodes that are not ours: {unknown}"
    assert find_cycles(drawn) == [], "the drawn picture itself has a circle"


def test_deepspeed_is_imported_only_in_integration():
    outside = sorted(f"{m}:{imp.line}" for m, imports in IMPORTS.items() for imp in imports
                     if imp.target.split(".")[0] == "deepspeed" and node_of(m) != "integration")
    assert not outside, f"deepspeed imported outside ds_megatron/integration/: {outside}"


@pytest.mark.parametrize("module", torch_free_modules())
def test_the_torch_free_half_reaches_neither_torch_nor_deepspeed(module):
    ours, external = runtime_closure(module)
    heavy = {root: by for root, by in external.items() if root in HEAVY}
    assert not heavy, f"importing {module} loads {sorted(heavy)} (through {heavy})"


def test_function_level_imports_of_our_modules_sit_at_named_boundaries_with_a_reason():
    boundaries = boundary_modules()
    assert all(m in MODULES for m in boundaries), f"ARCHITECTURE.md names boundaries that are not modules: {boundaries}"
    problems = []
    for module, imports in IMPORTS.items():
        lines = open(MODULES[module]).read().splitlines()
        for imp in imports:
            if not (imp.in_function and imp.target.split(".")[0] == PACKAGE):
                continue
            if module not in boundaries:
                problems.append(f"{module}:{imp.line} imports {imp.target} inside a function (not a boundary)")
            elif "#" not in lines[imp.line - 1] and not lines[imp.line - 2].strip().startswith("#"):
                problems.append(f"{module}:{imp.line} imports {imp.target} at a boundary without a comment why")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_circle_and_a_stray_arrow():
    """The rules above can fail: a circle and an undrawn arrow made up here are found."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = package_edges()
    assert "integration" in edges["training"] and "training" not in edges["integration"]
    edges["integration"].add("training")
    assert find_cycles(edges), "integration -> training would close a circle"


def test_a_rank_starts_without_torch_distributed_checkpoint():
    # DCP (with torch.distributed.tensor and sympy) took ~1.7 s of every rank's start-up; it is imported when a
    # torch_dist checkpoint is written or read (checkpointing/torch_dist.py, export_fp32.py).
    code = ("import sys, ds_megatron.cli, ds_megatron.training.train, ds_megatron.checkpointing.export_fp32; "
            "print('torch.distributed.checkpoint' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
