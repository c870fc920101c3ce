"""One plugin loader (module identity by full path), estimator traits read instead of names, and DAPO's
group collector on hand-built rounds."""

from __future__ import annotations

import pytest
import torch
from support import padded_batch


def test_same_stem_plugin_files_in_two_folders_both_load(tmp_path):
    """Two `my_algos.py` files in different folders are two modules: both register (the old loader keyed
    modules by file stem, so the second file was silently skipped)."""
    from fusedrl.algorithms import list_adv_estimators
    from fusedrl.config import import_plugin

    for folder, name in (("team_a", "stem_test_est_a"), ("team_b", "stem_test_est_b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "my_algos.py").write_text(
            "from fusedrl.algorithms import register_adv_estimator\n"
            f"@register_adv_estimator({name!r})\n"
            "def est(token_level_rewards, response_mask, index, **kw):\n"
            "    return token_level_rewards, token_level_rewards\n"
        )
        import_plugin(str(tmp_path / folder / "my_algos.py"))
    assert {"stem_test_est_a", "stem_test_est_b"} <= set(list_adv_estimators())
    # Loading the same file again reuses its module: the registration does not run twice (no clash).
    import_plugin(str(tmp_path / "team_a" / "my_algos.py"))


def test_plugin_errors_name_the_file(tmp_path):
    from fusedrl.config import import_plugin

    with pytest.raises(ImportError, match="nowhere.py"):
        import_plugin(str(tmp_path / "nowhere.py"))
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ImportError, match="broken.py.*boom"):
        import_plugin(str(bad))


def test_estimator_traits_decide_roles_and_validation_not_names(tmp_path):
    """A user estimator that declares `needs_critic` gets a critic; one with `min_group_size=3` rejects
    n=2 — without any edit outside its own registration."""
    from fusedrl.algorithms import get_adv_traits, register_adv_estimator
    from fusedrl.config import ConfigError, load_config, needed_roles

    @register_adv_estimator("traits_test_valued", needs_critic=True, min_group_size=3)
    def valued(token_level_rewards, response_mask, index, **kw):
        return token_level_rewards, token_level_rewards

    assert get_adv_traits("traits_test_valued").needs_critic
    assert get_adv_traits("remax").needs_greedy_baseline and not get_adv_traits("grpo").needs_greedy_baseline
    assert get_adv_traits("gae").needs_critic and not get_adv_traits("rloo").needs_critic
    assert get_adv_traits("grpo").min_group_size == 2
    cfg = load_config(
        ["data.train_files=x", "algorithm.adv_estimator=traits_test_valued"], validate_config=False
    )
    assert needed_roles(cfg)["critic"]
    cfg = load_config(["data.train_files=x", "algorithm.adv_estimator=grpo"], validate_config=False)
    assert not needed_roles(cfg)["critic"]
    with pytest.raises(ConfigError, match=r"rollout.n`=2: `traits_test_valued`.*n >= 3"):
        load_config(
            [
                "data.train_files=x",
                "algorithm.adv_estimator=traits_test_valued",
                "actor_rollout_ref.rollout.n=2",
            ]
        )


def _round(scores_per_group: list[list[float]], tag: str):
    """One scored generation round: groups of equal size with the given sequence scores."""
    n = len(scores_per_group[0])
    rows = [s for g in scores_per_group for s in g]
    batch = padded_batch([2] * len(rows), [1] * len(rows), tp=2, tr=1, gen=torch.Generator().manual_seed(0))
    batch.token_level_scores = torch.tensor(rows).unsqueeze(-1)  # [B, 1]
    batch.uid = [f"{tag}{i // n}" for i in range(len(rows))]
    return batch


def test_group_collector_keeps_informative_groups_until_enough():
    from fusedrl.trainer.dynamic_sampling import GroupCollector

    collector = GroupCollector(want=3, n=2, max_rounds=5)
    # Round 1: groups a0 (1, 0) informative, a1 (1, 1) not, a2 (0, 0.5) informative -> 2 groups kept.
    assert collector.add(_round([[1.0, 0.0], [1.0, 1.0], [0.0, 0.5]], "a")) is None
    # Round 2: b0 uninformative, b1 informative -> 3 groups: done, cut to 3 groups x 2 samples.
    out = collector.add(_round([[0.0, 0.0], [0.2, 0.9]], "b"))
    assert out is not None and out.num_samples == 6
    assert out.field_list("uid") == ["a0", "a0", "a2", "a2", "b1", "b1"]
    assert out.token_level_scores.squeeze(-1).tolist() == pytest.approx([1.0, 0.0, 0.0, 0.5, 0.2, 0.9])


def test_group_collector_stops_after_max_rounds_naming_the_key():
    from fusedrl.trainer.dynamic_sampling import GroupCollector

    collector = GroupCollector(want=2, n=2, max_rounds=2)
    assert collector.add(_round([[1.0, 1.0]], "a")) is None
    with pytest.raises(RuntimeError, match="only 0 of 2 groups.*max_num_gen_batches"):
        collector.add(_round([[0.0, 0.0]], "b"))
