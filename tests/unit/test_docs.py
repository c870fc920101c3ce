"""The docs stay true to the code: the config reference is regenerated from the YAML, every key and every
registered algorithm is documented, and the paths and API names the docs mention exist.

Nothing heavy is imported: code names are checked against the source with `ast`, not by importing the
trainer (which pulls in Ray and transformers).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOC_FILES = ("concepts.md", "algorithms.md", "config.md", "architecture.md", "agentic.md")

# setuptools package-dir mapping of pyproject.toml: import name prefix -> source folder.
PACKAGE_DIRS = {
    "fusedrl.workers": ROOT / "workers",
    "fusedrl.trainer": ROOT / "trainer",
    "fusedrl.third_party": ROOT / "third_party",
    "fusedrl": ROOT / "fusedrl",
}

# Classes the docs refer to as `Class.member`, and the file that defines each.
CLASS_FILES = {
    "PPOTrainer": "trainer/ppo_trainer.py",
    "WorkerDict": "workers/worker_dict.py",
    "WorkerGroup": "fusedrl/controller/worker_group.py",
    "RolloutBatch": "fusedrl/batch.py",
    "VLLMEngine": "third_party/vllm/engine.py",
    "ActorRole": "workers/actor.py",
    "StreamStats": "workers/fsdp.py",
    "GroupCollector": "trainer/dynamic_sampling.py",
    "InspectionHooks": "workers/inspection.py",
    "DistributedWorker": "workers/distributed.py",
}


def _read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


@cache
def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- (a) config.md is generated
def test_config_md_is_up_to_date():
    gen = _generator()
    assert (DOCS / "config.md").read_text(encoding="utf-8") == gen.render(), (
        "docs/config.md is out of date: run `python scripts/gen_config_docs.py`"
    )
    assert gen.main(["--check"]) == 0


def test_check_mode_fails_on_a_stale_file(tmp_path, capsys):
    gen = _generator()
    stale = tmp_path / "config.md"
    stale.write_text(gen.render().replace("| `data.train_files` |", "| `data.train_file` |", 1))
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen.main(["--output", str(stale)]) == 0  # regenerates
    assert gen.main(["--check", "--output", str(stale)]) == 0


def test_comment_scanner():
    gen = _generator()
    text = (
        "# file header\n"
        "\n"
        "a:              # group a\n"
        "  # above b\n"
        "  b: 1          # on b\n"
        "  c:\n"
        "    d: '#x'     # quoted hash is a value\n"
        "\n"
        "  # a comment separated by a blank line still sits directly above e\n"
        "  e: [1, 2]\n"
        "f: ${a.b}       # first line,\n"
        "                # its continuation\n"
        "# and a note above g\n"
        "g: 2\n"
    )
    assert gen.scan_comments(text) == {
        "a": "group a",
        "a.b": "above b on b",
        "a.c": "",
        "a.c.d": "quoted hash is a value",
        "a.e": "a comment separated by a blank line still sits directly above e",
        "f": "first line, its continuation",
        "g": "and a note above g",
    }
    assert gen.format_value(1e-6) == "1e-6"
    assert gen.format_value({"lr": 0.5, "betas": [0.9, None]}) == "{lr: 0.5, betas: [0.9, null]}"


# ---------------------------------------------------------------------- (b) every key is documented
def _all_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in cfg:
        dotted = f"{prefix}{key!s}"
        keys.append(dotted)
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_interpolation():
            keys.extend(_all_keys(node, dotted + "."))
    return keys


def _config_md_part(yaml_path: str) -> str:
    """The part of config.md for one YAML file: from its "## ... `path`" heading to the next "## "."""
    text = _read("config.md")
    start = text.index(f"`{yaml_path}`\n")
    end = text.find("\n## ", start)
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize("yaml_path", ["trainer/config/ppo_trainer.yaml", "trainer/config/sft_trainer.yaml"])
def test_every_yaml_key_is_in_config_md(yaml_path):
    part = _config_md_part(yaml_path)
    keys = _all_keys(OmegaConf.load(ROOT / yaml_path))
    assert len(keys) > 20
    # A top-level key is a "### `key`" heading over its table; every other key is a table row.
    missing = [k for k in keys if f"| `{k}` |" not in part and f"### `{k}`\n" not in part]
    assert not missing, f"keys of {yaml_path} missing from docs/config.md: {missing}"


def test_yaml_comments_and_raw_defaults_reach_the_table():
    gen = _generator()
    text = _config_md_part("trainer/config/ppo_trainer.yaml")
    yaml_path = ROOT / "trainer/config/ppo_trainer.yaml"
    described = {k: v for k, v in gen.scan_comments(yaml_path.read_text(encoding="utf-8")).items() if v}
    assert len(described) > 20
    rows = {line.split(" | ")[0][3:-1]: line for line in text.splitlines() if line.startswith("| `")}
    for key, description in described.items():
        if "." in key:  # top-level keys are headings with the description under them
            escaped = description.replace("|", "\\|").replace("<", "&lt;")  # as markdown cells need
            assert rows[key].endswith(f" | {escaped} |"), key
    # Interpolations are shown as written, not resolved.
    raw = OmegaConf.to_container(OmegaConf.load(yaml_path), resolve=False)
    assert raw["critic"]["model"]["path"].startswith("${")
    assert f"| `critic.model.path` | `{raw['critic']['model']['path']}` |" in text


# ---------------------------------------------------------------------- (c) every algorithm is documented
def test_every_registered_estimator_and_loss_is_in_algorithms_md():
    from fusedrl.algorithms import get_adv_estimator, get_policy_loss, list_adv_estimators, list_policy_losses
    from fusedrl.algorithms.kl import KL_KINDS
    from fusedrl.algorithms.losses import LOSS_AGG_MODES

    text = _read("algorithms.md")
    headings = set(re.findall(r"^### `([\w-]+)`", text, flags=re.M))
    # Built-ins only: tests that run earlier in the same process register plugins of their own.
    estimators = [n for n in list_adv_estimators() if get_adv_estimator(n).__module__.startswith("fusedrl.")]
    losses = [n for n in list_policy_losses() if get_policy_loss(n).__module__.startswith("fusedrl.")]
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "remax", "opo"} <= set(estimators)
    assert {"vanilla", "gspo"} <= set(losses)
    # Each estimator and loss has its own section; modes and KL kinds are at least named.
    assert not [n for n in [*estimators, *losses] if n not in headings], headings
    assert not [m for m in [*LOSS_AGG_MODES, *KL_KINDS] if f"`{m}`" not in text]


def test_each_algorithm_section_has_paper_keys_and_example():
    text = _read("algorithms.md")
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    assert len(sections) >= 10
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"arXiv \d{4}\.\d{4,5}", section), f"{title}: no arXiv id"
        assert "**Keys.**" in section, f"{title}: no config keys"
        assert "examples/" in section, f"{title}: no example"


# ---------------------------------------------------------------------- (d) paths and names exist
_EXAMPLE_PATH = re.compile(r"examples/[A-Za-z0-9_][A-Za-z0-9_./-]*")


def test_every_examples_path_in_the_docs_exists():
    found: set[str] = set()
    for name in DOC_FILES:
        found |= {m.rstrip(".") for m in _EXAMPLE_PATH.findall(_read(name))}
    assert len(found) >= 10, found
    missing = sorted(p for p in found if not (ROOT / p).exists())
    assert not missing, f"docs mention example paths that do not exist: {missing}"


@cache
def _class_members(cls_name: str) -> set[str]:
    tree = ast.parse((ROOT / CLASS_FILES[cls_name]).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            members: set[str] = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            for sub in ast.walk(node):  # instance attributes set in methods: self.x = ...
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    members.add(sub.attr)
            return members
    raise AssertionError(f"class {cls_name} not found in {CLASS_FILES[cls_name]}")


def test_class_members_named_in_the_docs_exist():
    pattern = re.compile(r"\b(" + "|".join(CLASS_FILES) + r")\.([A-Za-z_]\w*)")
    checked, missing = 0, []
    for name in DOC_FILES:
        for cls_name, member in pattern.findall(_read(name)):
            checked += 1
            if member not in _class_members(cls_name):
                missing.append(f"{name}: {cls_name}.{member}")
    assert checked >= 30
    assert not missing, missing


def _module_file(module: str) -> Path | None:
    for prefix, folder in PACKAGE_DIRS.items():
        if module == prefix or module.startswith(prefix + "."):
            rel = module[len(prefix) :].lstrip(".").replace(".", "/")
            base = folder / rel if rel else folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def _defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_python_snippets_parse_and_use_the_real_api():
    blocks = [b for name in DOC_FILES for b in _python_blocks(_read(name))]
    assert len(blocks) >= 5
    problems = []
    for block in blocks:
        tree = ast.parse(block)  # a SyntaxError here names the snippet
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fusedrl"):
                path = _module_file(node.module)
                if path is None:
                    problems.append(f"no module {node.module}")
                    continue
                defined = _defined_names(path)
                problems += [f"{node.module} has no {a.name}" for a in node.names if a.name not in defined]
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "PPOTrainer" for b in node.bases
            ):
                overrides = [f.name for f in node.body if isinstance(f, ast.FunctionDef)]
                problems += [
                    f"{node.name}.{m} overrides nothing in PPOTrainer"
                    for m in overrides
                    if m not in _class_members("PPOTrainer")
                ]
    assert not problems, problems


def test_config_keys_named_in_the_docs_exist():
    """Every dotted PPO config key in a code span of the prose docs is a real key (`rollout.x` / `actor.x`
    abbreviate `actor_rollout_ref.rollout.x` / `actor_rollout_ref.actor.x`)."""
    keys = set(_all_keys(OmegaConf.load(ROOT / "trainer/config/ppo_trainer.yaml")))
    sections = {k for k in keys if "." not in k}
    token = re.compile(r"(?<![\w.+$/{])([a-z_]+(?:\.[a-z_0-9]+)+)")
    checked, unknown = 0, []
    for name in ("concepts.md", "algorithms.md"):
        for span in re.findall(r"`([^`\n]+)`", _read(name)):
            for candidate in token.findall(span):
                head = candidate.split(".")[0]
                if head in ("rollout", "actor", "ref"):
                    candidate = f"actor_rollout_ref.{candidate}"
                elif head not in sections:
                    continue
                checked += 1
                if candidate not in keys:
                    unknown.append(f"{name}: {candidate}")
    assert checked >= 50
    assert not unknown, unknown
