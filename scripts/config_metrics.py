"""The config figures of docs/architecture.md's before/after table, measured on the source tree.

    .venv/bin/python scripts/config_metrics.py [--cycles]

Prints:

- **config paths the driver reads as strings**: in the driver's modules (`DRIVER_FILES`), reads of a YAML
  key path from the DictConfig: ``config.<section>...`` / ``cfg.<section>...`` attribute chains on a
  DictConfig name, ``.get("...")`` / ``OmegaConf.select(..., "a.b")`` / ``driver_value(..., "a.b")`` string
  lookups. One count per occurrence (a line may hold several).
- **`validate`'s size**: the lines of ``fusedrl.config_checks.validate`` (its ``def`` to its last line).
- **import cycles**: the import graph of ``fusedrl/``, ``workers/``, ``trainer/`` and ``third_party/`` (the
  last three install as ``fusedrl.workers`` / ``fusedrl.trainer`` / ``fusedrl.third_party``), built with
  ``ast`` from every ``import`` statement, the ones inside functions and ``if TYPE_CHECKING`` blocks
  included. An edge goes to the module named (``from a.b import c`` reaches ``a.b``, and ``a.b.c`` when
  that is a module); the implicit import of parent packages is not an edge. Reported: the strongly
  connected components with more than one module (each holds at least one cycle), their sizes, and the
  mutual pairs (two modules importing each other). ``--cycles`` lists the components' modules.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fusedrl": "fusedrl", "workers": "fusedrl.workers", "trainer": "fusedrl.trainer",
            "third_party": "fusedrl.third_party"}  # fmt: skip
DRIVER_FILES = [
    "trainer/ppo_trainer.py",
    "trainer/step_plan.py",
    "trainer/health_checks.py",
    "trainer/data_setup.py",
    "trainer/validation.py",
    "trainer/reward_scoring.py",
    "trainer/dynamic_sampling.py",
    "trainer/async_trainer.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "fusedrl" / "rewards").glob("*.py")),
]
SECTIONS = (
    "actor_rollout_ref|trainer|data|algorithm|critic|reward_model|custom_reward_function|async_training"
)
# A YAML key path read from a DictConfig: ``config.trainer.x`` / ``cfg.data.x``, or a string lookup.
KEY_PATH_READS = re.compile(
    rf"\b(?:config|cfg)\.(?:{SECTIONS})\b"
    r"|\.get\(\s*[\"'][a-z_]+[\"']"
    r"|OmegaConf\.select\([^,]+,\s*[\"'][a-z_.]+[\"']"
    r"|driver_value\([^,]+,[^,]+,\s*[\"'][a-z_.]+[\"']"
)


def key_path_reads(files: list[str] = DRIVER_FILES) -> dict[str, int]:
    """Occurrences of `KEY_PATH_READS` per driver file (comments and docstrings excluded)."""
    counts: dict[str, int] = {}
    for rel in files:
        path = ROOT / rel
        if not path.exists():
            continue
        n = 0
        for line in _code_lines(path.read_text()):
            n += len(KEY_PATH_READS.findall(line))
        counts[rel] = n
    return counts


def _code_lines(source: str) -> list[str]:
    """The source's lines with comments and docstrings blanked (string constants that are statements)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            for i in range(node.lineno - 1, (node.end_lineno or node.lineno)):
                lines[i] = ""
    return [line.split("#", 1)[0] for line in lines]


def validate_size() -> int:
    tree = ast.parse((ROOT / "fusedrl" / "config_checks.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "validate":
            return (node.end_lineno or node.lineno) - node.lineno + 1
    return 0


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p.startswith(".") or p == "config" for p in rel.parts[:-1]):
                continue
            name = ".".join([dotted, *parts])
            if folder == "fusedrl" and parts and parts[0] in ("workers", "trainer", "third_party"):
                continue  # not in the source layout; the top-level folders are these packages
            mods[name] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
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
    reads = key_path_reads()
    total = sum(reads.values())
    print(
        f"config paths read as strings by the driver: {total} in {sum(1 for n in reads.values() if n)} files"
    )
    for rel, n in reads.items():
        if n:
            print(f"  {rel}: {n}")
    print(f"validate: {validate_size()} lines")
    graph = import_graph()
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
