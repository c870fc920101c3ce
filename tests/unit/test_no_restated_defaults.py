"""The YAML is the one source of defaults: no ``cfg.get("key", default)`` in the roles, rewards or trainers.

A ``.get`` with a default on a config section would restate (and could contradict) the YAML's value. The
receivers listed in ``NOT_CONFIG`` are other dicts (checkpoint metadata, metric sums, the environment).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("workers", "trainer", "fusedrl/rewards")
NOT_CONFIG = {
    "extra",
    "meta",
    "state",
    "metrics",
    "sums",
    "mini_terms",
    "os.environ",
    "e",
    "g_now",
    "self.sinks",
    "mask_kwargs",  # Transformers' mask-builder keywords (workers/cpu_attention.py::one_row_mask)
    "self.step",  # the step each kept generation came from (workers/resident_store.py)
    "exports",  # rows each rank fetches from another's store (trainer/resident.py)
}


def _receiver(node: ast.AST) -> str:
    return ast.unparse(node)


def test_no_get_with_a_default_on_config_sections():
    offenders = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr != "get" or len(node.args) < 2:
                    continue
                default = node.args[1]
                if isinstance(default, ast.Constant) and default.value is None:
                    continue
                receiver = _receiver(node.func.value)
                if receiver in NOT_CONFIG:
                    continue
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "defaults restated outside the YAML:\n" + "\n".join(offenders)


# Subscripts whose receiver looks like a config but is another dict: PEFT's adapter configs.
NOT_ROLE_CONFIG = {"model.peft_config"}
ROLE_FOLDERS = ("workers", "fusedrl/rewards")


def test_roles_read_typed_configs_not_dicts():
    """Workers and rewards get `fusedrl.role_config` dataclasses: attributes (``cfg.actor.optim.lr``), no
    ``config["key"]`` / ``cfg["key"]`` lookups on a config dict, and no ``.get(key)`` on one either."""
    offenders = []
    for folder in ROLE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Subscript):
                    receiver = _receiver(node.value)
                    keyed = isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get"
                ):
                    receiver, keyed = _receiver(node.func.value), True
                else:
                    continue
                last = receiver.rsplit(".", 1)[-1].lower()
                if (
                    keyed
                    and receiver not in NOT_ROLE_CONFIG
                    and (last.endswith("cfg") or last.endswith("config"))
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "config dicts read in the roles:\n" + "\n".join(offenders)
