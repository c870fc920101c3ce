"""The typed role configs (fusedrl/role_config.py) cannot drift from the YAML, carry its defaults, travel
to Ray actors, and the PPO and SFT validators share one numeric check."""

from __future__ import annotations

import dataclasses
import pickle
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusedrl.config import role_configs_from_overrides
from fusedrl.role_config import RoleConfigs, TokenIds, build_role_configs
from fusedrl.sft_role_config import SFTRoleConfigs, build_sft_role_configs

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "trainer" / "config"
# Fields of the run-config objects that are no YAML key: values the driver derives and hands over typed.
DERIVED = {"tokens", "agent_tools", "total_steps"}
# `RoleConfigs` splits the YAML's `actor_rollout_ref` section into one field per role.
ARR = ("model", "actor", "ref", "rollout")


def _yaml(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())


def _ppo_sections(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML's sections under `RoleConfigs`'s field names."""
    out = {k: v for k, v in tree.items() if k != "actor_rollout_ref"}
    out.update({k: tree["actor_rollout_ref"][k] for k in ARR})
    return out


def _drift(cls: type, section: Mapping[str, Any], where: str) -> list[str]:
    """Every YAML key that is no field and every field that is no YAML key, recursively."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)} - (DERIVED if where == "" else set())
    keys = set(section)
    out = [f"{where}{k}: a YAML key with no field" for k in sorted(keys - fields)]
    out += [f"{where}{k}: a field with no YAML key" for k in sorted(fields - keys)]
    for name in sorted(fields & keys):
        if dataclasses.is_dataclass(hints[name]):
            assert isinstance(section[name], dict), f"{where}{name} is a section in the dataclasses only"
            out += _drift(hints[name], section[name], f"{where}{name}.")
        else:  # a leaf field holds a value, or a free-form mapping ({} / null in the YAML)
            assert not isinstance(section[name], dict) or section[name] == {}, f"{where}{name} is a section"
    return out


def test_ppo_fields_are_the_yaml_keys():
    assert _drift(RoleConfigs, _ppo_sections(_yaml("ppo_trainer")), "") == []


def test_sft_fields_are_the_yaml_keys():
    assert _drift(SFTRoleConfigs, _yaml("sft_trainer"), "") == []


def _as_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_as_plain(v) for v in value]
    return value


def _omegaconf_free(value: Any, where: str = "") -> None:
    assert "omegaconf" not in type(value).__module__, f"{where}: {type(value)}"
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _omegaconf_free(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _omegaconf_free(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        assert isinstance(value, tuple), f"{where}: a list in a frozen config"
        for v in value:
            _omegaconf_free(v, where)


def test_ppo_builder_gives_the_yaml_defaults_and_pickles():
    from fusedrl.config import load_config, to_plain_dict

    overrides = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=/m"]
    plain = to_plain_dict(load_config(overrides, validate_config=False))
    cfg = build_role_configs(plain, tokens=TokenIds(eos=2, pad=0), agent_tools=["tool"], total_steps=7)
    built = _as_plain(cfg)
    assert built.pop("tokens") == {"eos": 2, "pad": 0} and built.pop("agent_tools") == ["tool"]
    assert built.pop("total_steps") == 7
    assert built == _ppo_sections(plain)  # every value, nested, is the resolved YAML's
    # A few values read straight from the YAML text, interpolations included:
    assert cfg.actor.optim.weight_decay == 0.01 and cfg.actor.optim.betas == (0.9, 0.999)
    assert cfg.rollout.dtype == "bfloat16" and cfg.actor.use_kl_loss is False
    # `auto` keys reach the workers unresolved: each resolves them for its device (fusedrl.auto_defaults).
    assert cfg.actor.fsdp_config.param_dtype == "auto" and cfg.critic.model.use_remove_padding == "auto"
    assert cfg.ref.log_prob_use_dynamic_bsz is False  # ${...rollout.log_prob_use_dynamic_bsz} -> actor's
    assert cfg.critic.model.path == "/m" and cfg.actor.checkpoint.load_contents == (
        "model",
        "optimizer",
        "extra",
    )
    _omegaconf_free(cfg, "RoleConfigs")
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # what Ray does to ship it to the workers
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.optim.lr = 1.0  # type: ignore[misc]
    wider = cfg.with_slots(nnodes=2, n_gpus_per_node=4)
    assert (wider.trainer.nnodes, wider.trainer.n_gpus_per_node, cfg.trainer.nnodes) == (2, 4, 1)


def test_sft_builder_gives_the_yaml_defaults():
    from fusedrl.config import compose_config, to_plain_dict

    plain = to_plain_dict(
        compose_config(["data.train_files=t.parquet", "model.path=/m"], "sft_trainer", validate_config=False)
    )
    cfg = build_sft_role_configs(plain, total_steps=7)
    built = _as_plain(cfg)
    assert built.pop("total_steps") == 7
    assert built == plain
    assert cfg.optim.betas == (0.9, 0.95) and cfg.trainer.logger == ("console",)
    _omegaconf_free(cfg, "SFTRoleConfigs")
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_overrides_reach_the_typed_fields():
    cfg = role_configs_from_overrides(
        [
            "data.train_files=t",
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.actor.optim.lr=3e-4",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        ]
    )
    assert cfg.actor.optim.lr == 3e-4
    assert cfg.model.target_modules == ("q_proj", "v_proj")
    from fusedrl.config import load_config, to_plain_dict

    plain = to_plain_dict(
        load_config(["data.train_files=t", "actor_rollout_ref.model.path=/m"], validate_config=False)
    )
    plain["actor_rollout_ref"]["rollout"]["multi_turn"]["env_config"] = {"a": [1, 2]}
    cfg = build_role_configs(plain, tokens=TokenIds(eos=0, pad=0))
    assert cfg.rollout.multi_turn.env_config == {"a": [1, 2]}  # a free-form mapping stays as given


def test_a_missing_key_is_named():
    from fusedrl.config import load_config, to_plain_dict

    plain = to_plain_dict(
        load_config(["data.train_files=t", "actor_rollout_ref.model.path=/m"], validate_config=False)
    )
    del plain["actor_rollout_ref"]["actor"]["optim"]["betas"]
    with pytest.raises(KeyError, match=r"actor_rollout_ref\.actor\.optim\.betas"):
        build_role_configs(plain, tokens=TokenIds(eos=0, pad=0))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("role_config_files")
    model = build_tiny_model(str(root / "model"))
    train, _ = write_arithmetic_parquet(str(root / "data"), n_train=16, n_test=4, seed=0)
    return {"model": model, "train": train}


def _problems(load: Any, overrides: list[str]) -> list[str]:
    from fusedrl.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load(overrides)
    return info.value.problems


def test_ppo_and_sft_refuse_a_fraction_for_an_integer_key(files):
    from fusedrl.config import load_config
    from fusedrl.trainer.sft_trainer import load_sft_config

    ppo = _problems(
        load_config,
        [
            f"data.train_files={files['train']}",
            f"actor_rollout_ref.model.path={files['model']}",
            "actor_rollout_ref.rollout.name=hf",
            "trainer.total_epochs=2.5",
        ],
    )
    assert ppo == ["`trainer.total_epochs`=2.5: must be an integer."]
    sft = _problems(
        load_sft_config,
        [f"data.train_files={files['train']}", f"model.path={files['model']}", "trainer.total_epochs=2.5"],
    )
    assert sft == ["`trainer.total_epochs`=2.5: must be an integer."]
    # 2.0 is the integer 2 in both.
    load_config(
        [
            f"data.train_files={files['train']}",
            f"actor_rollout_ref.model.path={files['model']}",
            "actor_rollout_ref.rollout.name=hf",
            "trainer.total_epochs=2.0",
        ]
    )
