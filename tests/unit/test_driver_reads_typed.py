"""The PPO driver reads the typed run config (`fusedrl.role_config.RoleConfigs`, ``self.run.rollout.n``), not
key paths of the DictConfig (``self.config.actor_rollout_ref.rollout.n``, ``cfg.get("key")``,
``OmegaConf.select(cfg, "a.b")``): a renamed key is then an AttributeError at once (and a mypy error), not
a silent ``None`` at step 40.

``PPOTrainer.config`` stays the DictConfig for users' subclasses; the project's own driver code does not read
it. The detector is `scripts/config_metrics.py`'s (it also counts the figure of docs/architecture.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _metrics():
    spec = importlib.util.spec_from_file_location("config_metrics", ROOT / "scripts" / "config_metrics.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_driver_reads_attributes_of_the_typed_config():
    m = _metrics()
    src = m.Tree()
    files = m.driver_files(src)
    assert "trainer/ppo_trainer.py" in files and "fusedrl/rewards/manager.py" in files
    offenders = [hit for rel in files for hit in m.key_path_reads(rel, src.read(rel) or "")]
    assert not offenders, "config key paths read by the driver (read self.run's attributes):\n" + "\n".join(
        offenders
    )


def test_the_guard_sees_key_path_reads():
    """The check itself: each form it refuses is found in a sample, attribute reads of ``self.run`` are not."""
    sample = (
        "def f(self, cfg, OmegaConf, settings):\n"
        "    a = self.config.actor_rollout_ref.rollout.n\n"
        "    b = cfg.get('trainer')\n"
        "    c = cfg['data']\n"
        "    d = OmegaConf.select(cfg, 'data.seed')\n"
        "    e = driver_value(config, settings, 'data.seed')\n"
        "    f = self.run.rollout.n + driver_value(self.run.data.seed, settings, 'data.seed')\n"
    )
    hits = _metrics().key_path_reads("sample.py", sample)
    assert sorted(h.split(":")[1] for h in hits) == ["2", "3", "4", "5", "6"]


def test_the_config_checks_read_the_typed_sections():
    """The cross-section checks read ``run.<section>.<field>``; what is left reading key paths is the
    placement parser of the ``trainer`` mapping (`read_placement`, shared with callers holding plain dicts)
    and the one narrow raw read, `budget_interpolations`."""
    m = _metrics()
    src = m.Tree()
    files = m.check_files(src)
    assert "fusedrl/config_cross_checks.py" in files and "fusedrl/expert_parallel_checks.py" in files
    hits = [hit for rel in files for hit in m.check_key_path_reads(rel, src.read(rel) or "")]
    allowed = ("fusedrl/placement_config.py:", "fusedrl/config_sections.py:")
    assert all(h.startswith(allowed) for h in hits), "\n".join(hits)
    assert len(hits) <= 7, "\n".join(hits)
    sample = "def f(cfg, OmegaConf, key):\n    a = _get(cfg, 'a.b')\n    b = OmegaConf.select(cfg, key)\n"
    assert len(m.check_key_path_reads("sample.py", sample)) == 2
