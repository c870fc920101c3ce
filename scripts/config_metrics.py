"""The config figures of docs/architecture.md's before/after table, measured on the source tree.

    .venv/bin/python scripts/config_metrics.py [--rev COMMIT] [--cycles] [--list]

``--rev`` measures the files of a commit (``git show``) instead of the work tree. Prints:

- **config paths the driver reads as strings**: in the driver's modules (`DRIVER_FILES`), reads of a YAML
  key path from a config (`key_path_reads`, by ``ast``): ``<x>.<section>`` on a name ending in ``config``
  / ``cfg`` (``self.config.trainer``, ``cfg.data``; a chain counts once), ``["key"]`` / ``.get("key")``
  on such a name, ``OmegaConf.select(.., "a.b")``, and ``driver_value(config, .., "a.b")``. The functions
  in `ADAPTERS` (a library caller's partial config into typed sections) are not counted.
  ``tests/unit/test_driver_reads_typed.py`` holds the driver to 0.
- **config paths the checks read as strings**: the same reads in the config checks (`CHECKS` and
  ``fusedrl/*_checks.py``), plus their path helpers ``_get(cfg, "a.b")`` / ``_select(cfg, key)``; ``--list``
  prints each.
- **`validate`'s size**: the lines of ``fusedrl.config_checks.validate`` (its ``def`` to its last line).
- **import cycles**: the import graph of ``fusedrl/``, ``workers/``, ``trainer/`` and ``third_party/`` (the
  last three install as ``fusedrl.workers`` / ``fusedrl.trainer`` / ``fusedrl.third_party``), built with
  ``ast`` from every ``import`` statement, the ones inside functions and ``if TYPE_CHECKING`` blocks
  included. An edge goes to the module named (``from a.b import c`` reaches ``a.b.c`` when that is a
  module, and ``a.b`` when a name is not); the implicit import of parent packages is not an edge. Reported: the strongly
  connected components with more than one module (each holds at least one cycle), their sizes, and the
  mutual pairs (two modules importing each other). ``--cycles`` lists the components' modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fusedrl": "fusedrl", "workers": "fusedrl.workers", "trainer": "fusedrl.trainer",
            "third_party": "fusedrl.third_party"}  # fmt: skip
DRIVER = [
    "trainer/ppo_trainer.py",
    "trainer/step_plan.py",
    "trainer/health_checks.py",
    "trainer/data_setup.py",
    "trainer/validation.py",
    "trainer/reward_scoring.py",
    "trainer/dynamic_sampling.py",
    "trainer/async_trainer.py",
    "trainer/runtime.py",
]
# The config checks (`fusedrl.config_checks.validate`'s cross-section checks and the modules they call).
CHECKS = [
    "fusedrl/config_checks.py",
    "fusedrl/config_cross_checks.py",
    "fusedrl/config_sections.py",
    "fusedrl/async_config.py",
    "fusedrl/placement_config.py",
    "fusedrl/architecture_config.py",
    "fusedrl/chat_config.py",
    "fusedrl/auto_defaults.py",
]
# A partial DictConfig / dict from a library caller (no RoleConfigs at hand) into typed sections.
ADAPTERS = {("fusedrl/rewards/__init__.py", "typed_reward_sections")}
SECTIONS = {"actor_rollout_ref", "trainer", "data", "algorithm", "critic", "reward_model",
            "custom_reward_function", "async_training"}  # fmt: skip


class Tree:
    """The source files of the work tree, or of commit ``rev``."""

    def __init__(self, rev: str | None = None) -> None:
        self.rev = rev

    def files(self, folder: str) -> list[str]:
        if self.rev is None:
            return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py"))
        out = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", self.rev, folder], cwd=ROOT, check=True,
            capture_output=True, text=True,
        ).stdout  # fmt: skip
        return sorted(f for f in out.split() if f.endswith(".py"))

    def read(self, rel: str) -> str | None:
        if self.rev is None:
            path = ROOT / rel
            return path.read_text(encoding="utf-8") if path.exists() else None
        got = subprocess.run(["git", "show", f"{self.rev}:{rel}"], cwd=ROOT, capture_output=True, text=True)
        return got.stdout if got.returncode == 0 else None


def driver_files(tree: Tree) -> list[str]:
    return [*DRIVER, *(f for f in tree.files("fusedrl/rewards") if f.count("/") == 2)]


def _config_like(node: ast.AST) -> bool:
    last = ast.unparse(node).rsplit(".", 1)[-1].lower()
    return last.endswith("config") or last.endswith("cfg")


def key_path_reads(rel: str, source: str) -> list[str]:
    """``file:line: expression`` of each config key path read in ``source`` (module docstring)."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and (rel, fn.name) in ADAPTERS:
            skip.update(id(n) for n in ast.walk(fn))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        bad = False
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
            bad = _config_like(node.value)  # config.trainer / self.config.algorithm / cfg.data
        elif isinstance(node, ast.Subscript):
            key = node.slice
            bad = isinstance(key, ast.Constant) and isinstance(key.value, str) and _config_like(node.value)
        elif isinstance(node, ast.Call):
            args = node.args
            string_arg = any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args)
            name = ast.unparse(node.func)
            if name.endswith(".get") and isinstance(node.func, ast.Attribute):
                bad = string_arg and _config_like(node.func.value)
            elif name == "OmegaConf.select":
                bad = string_arg
            elif name == "driver_value":
                bad = string_arg and bool(args) and _config_like(args[0])
        if bad:
            found.append(f"{rel}:{getattr(node, 'lineno', 0)}: {ast.unparse(node)}")
    return found


def check_files(tree: Tree) -> list[str]:
    return [*CHECKS, *(f for f in tree.files("fusedrl") if f.endswith("_checks.py") and f.count("/") == 1)]


# Not counted: ``config.get(..)`` (a model folder's config.json) and the file of
# `auto_defaults.resolve_configs`, whose ``cfg`` is the typed `RoleConfigs`.


def check_key_path_reads(rel: str, source: str) -> list[str]:
    """`key_path_reads` plus the checks' own path readers: ``_get(cfg, "a.b")`` / ``_select(cfg, key)``
    (a call of ``_get`` / ``_select`` whose first argument is a config) and ``OmegaConf.select`` with a
    computed key; less the two kinds above."""
    found = key_path_reads(rel, source)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = ast.unparse(node.func)
        computed = name == "OmegaConf.select" and not any(
            isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args
        )
        if computed or (name in ("_get", "_select") and _config_like(node.args[0])):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    typed = "def resolve_configs" in source or "def _resolve_sft" in source
    return [h for h in found if not (h.split(": ", 1)[1].startswith("config.get(") or (typed and rel in h))]


def validate_size(src: Tree) -> int:
    tree = ast.parse(src.read("fusedrl/config_checks.py") or "")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "validate":
            return (node.end_lineno or node.lineno) - node.lineno + 1
    return 0


def _modules(src: Tree) -> dict[str, str]:
    mods: dict[str, str] = {}
    for folder, dotted in PACKAGES.items():
        for file in src.files(folder):
            rel = Path(file).relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p.startswith(".") or p == "config" for p in rel.parts[:-1]):
                continue
            name = ".".join([dotted, *parts])
            if folder == "fusedrl" and parts and parts[0] in ("workers", "trainer", "third_party"):
                continue  # not in the source layout; the top-level folders are these packages
            mods[name] = file
    return mods


def import_graph(src: Tree) -> dict[str, set[str]]:
    mods = _modules(src)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, file in mods.items():
        is_pkg = file.endswith("__init__.py")
        for node in ast.walk(ast.parse(src.read(file) or "")):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                # ``from a.b import c``: a.b.c when it is a module (a.b is then only its parent package,
                # imported implicitly, as for ``import a.b.c``), else a.b.
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in mods] or [base]
                if any(t not in mods for t in subs):
                    targets.append(base)
            for t in targets:
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main(argv: list[str]) -> int:
    rev = argv[argv.index("--rev") + 1] if "--rev" in argv else None
    src = Tree(rev)
    print(f"measured on {rev or 'the work tree'}")
    reads = {rel: key_path_reads(rel, text) for rel in driver_files(src) if (text := src.read(rel))}
    total = sum(map(len, reads.values()))
    print(
        f"config paths read as strings by the driver: {total} in {sum(1 for r in reads.values() if r)} files"
    )
    for rel, hits in reads.items():
        if hits:
            print(f"  {rel}: {len(hits)}")
    checks = {rel: check_key_path_reads(rel, text) for rel in check_files(src) if (text := src.read(rel))}
    print(
        f"config paths read as strings by the config checks: {sum(map(len, checks.values()))} in "
        f"{sum(1 for r in checks.values() if r)} files"
    )
    for rel, hits in checks.items():
        if hits:
            print(f"  {rel}: {len(hits)}")
            if "--list" in argv:
                print("\n".join(f"    {h}" for h in hits))
    print(f"validate: {validate_size(src)} lines")
    graph = import_graph(src)
    comps = strongly_connected(graph)
    pairs = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})
    print(
        f"import cycles: {len(comps)} components holding {sum(map(len, comps))} modules "
        f"(sizes {sorted(map(len, comps), reverse=True)}), {len(pairs)} mutual pairs"
    )
    for a, b in pairs:
        print(f"  {a} <-> {b}")
    if "--cycles" in argv:
        for comp in comps:
            print("  component:", ", ".join(comp))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
