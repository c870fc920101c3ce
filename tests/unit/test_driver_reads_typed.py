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
