"""``auto`` defaults (fusedrl/auto_defaults.py): what each key resolves to on a CPU with native bf16, on one
without, on a CUDA worker with and without flash-attn; that an explicit value always wins; the start-up
line; and the driver's conservative reading of an ``auto`` no worker resolved."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from fusedrl.auto_defaults import (
    AUTO,
    COMPILE_MIN_STEPS,
    DeviceFacts,
    agreed_facts,
    compiles_for,
    describe,
    local_facts,
    merge_reports,
    report,
    require_resolved,
    resolve_configs,
)
from fusedrl.role_config import RoleConfigs, TokenIds, build_role_configs

ARR = "actor_rollout_ref"
DTYPE_KEYS = (
    f"{ARR}.actor.fsdp_config.param_dtype",
    f"{ARR}.ref.fsdp_config.param_dtype",
    "critic.model.fsdp_config.param_dtype",
)
AMX_CPU = DeviceFacts(device="CPU fake AMX", cuda=False, native_bf16=True, flash_attn=False, missing_cxx=None)
AVX2_CPU = DeviceFacts(
    device="CPU fake AVX2", cuda=False, native_bf16=False, flash_attn=False, missing_cxx=None
)
CUDA_SDPA = DeviceFacts(device="CUDA fake", cuda=True, native_bf16=True, flash_attn=False, missing_cxx=None)
CUDA_FLASH = dataclasses.replace(CUDA_SDPA, flash_attn=True)
LONG = COMPILE_MIN_STEPS  # planned steps at which compiling pays


def _configs(*overrides: str, total_steps: int | None = LONG) -> RoleConfigs:
    """The YAML's defaults as the driver hands them to the workers (``auto`` unresolved)."""
    from fusedrl.config import load_config, to_plain_dict

    base = ["data.train_files=t", f"{ARR}.model.path=/m", *overrides]
    plain = to_plain_dict(load_config(base, validate_config=False))
    return build_role_configs(plain, tokens=TokenIds(eos=0, pad=0), total_steps=total_steps)


def _values(cfg: RoleConfigs) -> dict[str, object]:
    return {
        "actor_dtype": cfg.actor.fsdp_config.param_dtype,
        "ref_dtype": cfg.ref.fsdp_config.param_dtype,
        "critic_dtype": cfg.critic.model.fsdp_config.param_dtype,
        "packed": cfg.model.use_remove_padding,
        "critic_packed": cfg.critic.model.use_remove_padding,
        "compiled": cfg.model.compile_layers,
        "critic_compiled": cfg.critic.model.compile_layers,
    }


def test_the_yaml_defaults_are_auto():
    cfg = _configs()
    assert set(_values(cfg).values()) == {AUTO}  # the critic's interpolate the actor's model keys
    sft = _sft_configs()
    assert sft.model.fsdp_config.param_dtype == AUTO
    from pathlib import Path

    yaml = (Path(__file__).resolve().parents[2] / "trainer" / "config" / "ppo_trainer.yaml").read_text()
    assert f">= {COMPILE_MIN_STEPS} planned" in yaml  # the documented rule is the code's


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        # A CPU with AVX-512 BF16 / AMX: bf16 mixed precision, packed rows, compiled on a long run.
        (AMX_CPU, ("bfloat16", True, True)),
        # An AVX2-only CPU: the model dtype, packed rows (fusedrl's CPU attention), float32 is never compiled.
        (AVX2_CPU, (None, True, False)),
        # CUDA without flash-attn: packed rows would run SDPA over a dense mask, so padded and not compiled.
        (CUDA_SDPA, ("bfloat16", False, False)),
        # CUDA with flash-attn: packed, and compiled on a long run.
        (CUDA_FLASH, ("bfloat16", True, True)),
    ],
    ids=["native-bf16-cpu", "avx2-cpu", "cuda-sdpa", "cuda-flash-attn"],
)
def test_each_auto_key_per_device(facts, expected):
    dtype, packed, compiled = expected
    resolved, chosen = resolve_configs(_configs(), facts)
    assert _values(resolved) == {
        "actor_dtype": dtype,
        "ref_dtype": dtype,
        "critic_dtype": dtype,
        "packed": packed,
        "critic_packed": packed,
        "compiled": compiled,
        "critic_compiled": compiled,
    }
    assert set(chosen) == {
        *DTYPE_KEYS,
        *(
            f"{s}.{k}"
            for s in (f"{ARR}.model", "critic.model")
            for k in ("use_remove_padding", "compile_layers")
        ),
        f"{ARR}.rollout.sleep_level",
    }
    assert resolved.rollout.sleep_level == (2 if facts.cuda else 1)
    assert resolve_configs(resolved, facts) == (
        resolved,
        {},
    )  # nothing auto is left: resolving again is a no-op


def test_sleep_level_per_device_and_lora():
    """2 on CUDA (the stream overwrites every weight), 1 under LoRA (adapter-only streams need the base
    weights) and on CPU (no sleep mode: nothing released); an explicit level wins."""
    key = f"{ARR}.rollout.sleep_level"
    lora = (f"{ARR}.model.lora_rank=8", f"{ARR}.model.target_modules=all-linear")
    for facts, overrides, level in (
        (CUDA_SDPA, (), 2),
        (CUDA_FLASH, lora, 1),
        (AMX_CPU, (), 1),
        (AVX2_CPU, lora, 1),
        (CUDA_SDPA, (f"{key}=1",), 1),
        (AVX2_CPU, (f"{key}=2",), 2),
    ):
        resolved, chosen = resolve_configs(_configs(*overrides), facts, roles=["rollout"])
        assert resolved.rollout.sleep_level == level, (facts.device, overrides)
        assert (key in chosen) == (not any(o.startswith(key) for o in overrides))
    # a worker without the rollout reports nothing about it
    assert key not in resolve_configs(_configs(), CUDA_SDPA, roles=["actor"])[1]


def test_an_explicit_value_always_wins():
    explicit = [
        *(f"{key}=float32" for key in DTYPE_KEYS),
        f"{ARR}.model.use_remove_padding=false",
        f"{ARR}.model.compile_layers=false",
        f"{ARR}.rollout.sleep_level=1",
    ]
    for facts in (AMX_CPU, CUDA_FLASH):
        resolved, chosen = resolve_configs(_configs(*explicit), facts)
        assert chosen == {}
        assert _values(resolved) == {
            "actor_dtype": "float32",
            "ref_dtype": "float32",
            "critic_dtype": "float32",
            "packed": False,
            "critic_packed": False,  # interpolates the actor's explicit value
            "compiled": False,
            "critic_compiled": False,
        }
    # Explicit on a device where auto would choose the other way: kept as well.
    on = [
        f"{ARR}.model.use_remove_padding=true",
        f"{ARR}.model.compile_layers=true",
        f"{DTYPE_KEYS[0]}=bfloat16",
    ]
    resolved, chosen = resolve_configs(_configs(*on, total_steps=1), CUDA_SDPA)
    assert (resolved.model.use_remove_padding, resolved.model.compile_layers) == (True, True)
    assert resolved.actor.fsdp_config.param_dtype == "bfloat16" and DTYPE_KEYS[0] not in chosen
    # One key set, the others still auto: each resolves on its own.
    resolved, chosen = resolve_configs(_configs(f"{DTYPE_KEYS[1]}=null"), AMX_CPU)
    assert (
        resolved.ref.fsdp_config.param_dtype is None and resolved.actor.fsdp_config.param_dtype == "bfloat16"
    )
    assert DTYPE_KEYS[1] not in chosen


def test_packing_follows_the_named_attention():
    for impl in ("sdpa", "eager"):  # Transformers attends a packed row through its dense block mask
        resolved, chosen = resolve_configs(_configs(f"{ARR}.model.attn_implementation={impl}"), AMX_CPU)
        assert resolved.model.use_remove_padding is False and resolved.model.compile_layers is False
        assert f"attn_implementation={impl}" in chosen[f"{ARR}.model.use_remove_padding"][1]
    resolved, _ = resolve_configs(_configs(f"{ARR}.model.attn_implementation=flash_attention_2"), CUDA_FLASH)
    assert resolved.model.use_remove_padding is True
    # The critic has an attention key of its own: packed or not on its own.
    resolved, _ = resolve_configs(_configs("critic.model.attn_implementation=sdpa"), AVX2_CPU)
    assert (resolved.model.use_remove_padding, resolved.critic.model.use_remove_padding) == (True, False)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({}, f"{LONG} planned steps"),
        ({"planned_steps": LONG - 1}, f"{LONG - 1} planned steps"),
        ({"planned_steps": None}, "run length unknown"),
        ({"packed": False}, "padded rows"),
        ({"half": False}, "float32 compute"),
        ({"lora": True}, "LoRA"),
        ({"ulysses": True}, "Ulysses"),
        ({"expert_parallel": True}, "expert parallelism"),
        ({"vision_language": True}, "a vision-language model"),
        ({"facts": dataclasses.replace(AMX_CPU, missing_cxx="g++")}, "no C++ compiler (g++)"),
    ],
)
def test_the_compile_rule(kwargs, why):
    args = {
        "packed": True,
        "half": True,
        "planned_steps": LONG,
        "lora": False,
        "ulysses": False,
        "facts": AMX_CPU,
    }
    on, reason = compiles_for(AUTO, **{**args, **kwargs})
    assert (on, reason) == (not kwargs, why)
    assert compiles_for(True, **{**args, **kwargs}) == (
        True,
        "explicit",
    )  # refused combinations: config checks


def test_compile_reads_the_planned_steps_and_the_role(tmp_path):
    short = _configs(total_steps=LONG - 1)
    assert resolve_configs(short, AMX_CPU)[0].model.compile_layers is False
    # Without a count from the trainer (roles built directly), trainer.total_training_steps decides.
    assert resolve_configs(_configs(f"trainer.total_training_steps={LONG}", total_steps=None), AMX_CPU)[
        0
    ].model.compile_layers
    lora = resolve_configs(_configs(f"{ARR}.model.lora_rank=4"), AMX_CPU)[0]
    assert (
        lora.model.compile_layers is False and lora.critic.model.compile_layers is True
    )  # the critic has no LoRA
    vlm_dir = tmp_path / "vlm"
    vlm_dir.mkdir()
    (vlm_dir / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    vlm = resolve_configs(_configs(f"{ARR}.model.path={vlm_dir}"), AMX_CPU)[0]
    assert vlm.model.compile_layers is False  # a VLM's layers are not compiled (the worker refuses them)
    sp = resolve_configs(_configs(f"{ARR}.actor.ulysses_sequence_parallel_size=2"), AMX_CPU)[0]
    assert sp.model.compile_layers is False and sp.critic.model.compile_layers is True
    fp32 = resolve_configs(_configs(f"{DTYPE_KEYS[0]}=float32"), AMX_CPU)[0]
    assert fp32.model.compile_layers is False and fp32.critic.model.compile_layers is True


def test_a_group_agrees_on_the_weakest_device():
    facts = agreed_facts([AMX_CPU, AVX2_CPU])
    assert facts.native_bf16 is False and facts.device == "CPU fake AMX / CPU fake AVX2"
    assert agreed_facts([AMX_CPU, AMX_CPU]) == AMX_CPU
    assert agreed_facts([CUDA_FLASH, CUDA_SDPA]).flash_attn is False
    assert agreed_facts([AMX_CPU, dataclasses.replace(AMX_CPU, missing_cxx="g++")]).missing_cxx == "g++"


def test_local_facts_with_the_detector_injected_and_on_a_fake_cuda_worker(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    native = local_facts(detect=lambda: (True, "CPU fake AMX (amx_bf16)"))
    assert (native.native_bf16, native.cuda, native.device) == (True, False, "CPU fake AMX (amx_bf16)")
    assert local_facts(detect=lambda: (False, "CPU fake AVX2")).native_bf16 is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    for has_flash in (False, True):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, flash=has_flash: (
                (object() if flash else None) if name == "flash_attn" else real_find_spec(name, *a)
            ),
        )
        cuda = local_facts(detect=lambda: (True, "CUDA device fake"))
        assert (cuda.cuda, cuda.flash_attn, cuda.missing_cxx) == (True, has_flash, None)
        resolved = resolve_configs(_configs(), cuda)[0]
        assert (
            resolved.model.use_remove_padding is has_flash
            and resolved.actor.fsdp_config.param_dtype == "bfloat16"
        )


def test_the_avx2_cap_resolves_to_the_model_dtype():
    """A CPU capped at AVX2 (`make test-avx2`'s environment) has no native bf16: param_dtype=auto is null."""
    from fusedrl.utils.hardware import AVX2_CAP_ENV

    code = (
        "from fusedrl.auto_defaults import local_facts, param_dtype_for\n"
        "f = local_facts()\n"
        "print(f.native_bf16, param_dtype_for('auto', f)[0])\n"
    )
    env = {**os.environ, **AVX2_CAP_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "None"]


def test_the_start_up_line():
    resolved, chosen = resolve_configs(_configs(total_steps=40), AVX2_CPU, roles=["actor", "rollout"])
    line = describe(chosen, AVX2_CPU)
    assert line == (
        "fusedrl: auto defaults on CPU fake AVX2: "
        "actor_rollout_ref.actor.fsdp_config.param_dtype=null (no native bf16: the model dtype), "
        "actor_rollout_ref.model.use_remove_padding=true (fusedrl's CPU attention attends each packed sequence), "
        "actor_rollout_ref.model.compile_layers=false (float32 compute), "
        "actor_rollout_ref.rollout.sleep_level=1 (no sleep mode on CPU: nothing is released at either level). "
        f"compile_layers=auto compiles with packed rows, bf16/fp16 compute and >= {LONG} planned steps "
        "(not with LoRA, Ulysses, expert parallelism, or without a C++ compiler on CPU)"
    )
    assert "\n" not in line
    # Only the keys of the roles a worker holds are named (no critic in a GRPO worker; the sleep level alone
    # for a rollout).
    assert set(resolve_configs(_configs(), AVX2_CPU, roles=["rollout"])[1]) == {f"{ARR}.rollout.sleep_level"}
    _, with_ref = resolve_configs(_configs(), AMX_CPU, roles=["ref"])
    assert set(with_ref) == {DTYPE_KEYS[1], f"{ARR}.model.use_remove_padding", f"{ARR}.model.compile_layers"}
    _, lora = resolve_configs(_configs(f"{ARR}.model.lora_rank=4"), AMX_CPU, roles=["actor", "ref"])
    assert DTYPE_KEYS[1] not in lora  # the LoRA reference is the actor with its adapters off
    assert describe({}, AVX2_CPU) == ""
    assert "compile_layers=auto" not in describe({DTYPE_KEYS[0]: ("bfloat16", "native bf16")}, AMX_CPU)


def test_the_driver_merges_reports_and_treats_disagreement_as_auto():
    a = report({DTYPE_KEYS[0]: ("bfloat16", "native bf16")}, AMX_CPU)
    b = report({DTYPE_KEYS[0]: (None, "no native bf16")}, AVX2_CPU)
    assert a["settings"] == {DTYPE_KEYS[0]: "bfloat16"}
    assert merge_reports([a, a]) == ({DTYPE_KEYS[0]: "bfloat16"}, [a["line"]])
    settings, lines = merge_reports([a, b, a])
    assert settings == {DTYPE_KEYS[0]: AUTO} and lines == [a["line"], b["line"]]
    assert merge_reports([report({}, AMX_CPU)]) == ({}, [])


def test_announce_prints_each_line_once():
    from types import SimpleNamespace

    from fusedrl.auto_defaults import announce_resolved

    rep = report({f"{ARR}.model.use_remove_padding": (True, "fusedrl's CPU attention")}, AVX2_CPU)

    class Worker:
        class resolved_defaults:  # noqa: N801 (a Ray actor method's `.remote`)
            @staticmethod
            def remote():
                return rep

    groups = [SimpleNamespace(run_rank0=lambda call: call(Worker())) for _ in range(2)]
    printed: list[str] = []
    assert announce_resolved(groups, printed.append) == {f"{ARR}.model.use_remove_padding": True}
    assert printed == [rep["line"]]


def test_the_driver_reads_auto_conservatively():
    from omegaconf import OmegaConf

    from fusedrl.config import load_config
    from fusedrl.role_config import run_config
    from fusedrl.trainer.health_checks import rollout_check_bound
    from fusedrl.trainer.step_plan import prompt_groups_whole

    cfg = load_config(
        ["data.train_files=t", f"{ARR}.model.path=/m", f"{ARR}.rollout.dtype=float32"], validate_config=False
    )
    assert OmegaConf.select(cfg.source, DTYPE_KEYS[0]) == AUTO  # the composed config, as written
    cfg = run_config(cfg)  # the typed config the driver reads
    assert rollout_check_bound(cfg) == 0.1  # unresolved: the actor may compute in bf16
    assert rollout_check_bound(cfg, {DTYPE_KEYS[0]: None}) == 1e-3  # resolved float32 on both sides
    assert rollout_check_bound(cfg, {DTYPE_KEYS[0]: "bfloat16"}) == 0.1
    key = f"{ARR}.model.use_remove_padding"
    assert (
        prompt_groups_whole(cfg, {}) is True
    )  # unresolved: keep a prompt's rows together (right either way)
    assert prompt_groups_whole(cfg, {key: False}) is False and prompt_groups_whole(cfg, {key: True}) is True
    assert prompt_groups_whole(cfg, {key: AUTO}) is True  # groups disagreed


def test_the_emulated_bf16_switch_leaves_auto_alone():
    from omegaconf import OmegaConf

    from fusedrl.config import compose_config
    from fusedrl.cpu_dtype import apply_cpu_dtype_policy

    cfg = compose_config(["data.train_files=t", f"{ARR}.model.path=/m"], validate_config=False)
    switched = apply_cpu_dtype_policy(cfg, detect=lambda: (False, "CPU fake AVX2"))
    assert switched == [f"{ARR}.rollout.dtype"]  # verl's explicit bf16 engine default, not the auto keys
    assert [OmegaConf.select(cfg, key) for key in DTYPE_KEYS] == [AUTO] * 3


def test_config_checks_accept_auto_and_name_bad_values():
    from fusedrl.config import load_config
    from fusedrl.config_sections import auto_key_problems, compile_layers_problems

    def problems(*overrides: str) -> list[str]:
        return auto_key_problems(
            load_config(["data.train_files=t", f"{ARR}.model.path=/m", *overrides], validate_config=False)
        )

    assert problems() == []
    assert (
        problems(f"{DTYPE_KEYS[0]}=null", f"{DTYPE_KEYS[1]}=bf16", f"{ARR}.model.compile_layers=true") == []
    )
    bad = problems(f"{DTYPE_KEYS[2]}=bfloat61", f"{ARR}.model.use_remove_padding=ture")
    assert len(bad) == 3, bad  # the critic's use_remove_padding interpolates the actor's: both named
    assert bad[0].startswith(f"`{DTYPE_KEYS[2]}`='bfloat61': use auto, null (model_dtype) or one of ")
    assert bad[1] == f"`{ARR}.model.use_remove_padding`='ture': use auto, true or false."
    assert bad[2].startswith("`critic.model.use_remove_padding`='ture'")
    lora = ["data.train_files=t", f"{ARR}.model.path=/m", f"{ARR}.model.lora_rank=4"]
    assert compile_layers_problems(load_config(lora, validate_config=False), with_critic=False) == []  # auto
    on = load_config([*lora, f"{ARR}.model.compile_layers=true"], validate_config=False)
    assert compile_layers_problems(on, with_critic=False)[0].startswith(
        f"`{ARR}.model.compile_layers`=true with"
    )


def test_roles_refuse_unresolved_auto_and_test_configs_come_resolved():
    from fusedrl.config import role_configs_from_overrides

    with pytest.raises(
        ValueError, match=r"critic.model: use_remove_padding=auto reached the role unresolved"
    ):
        require_resolved("critic.model", use_remove_padding=AUTO, param_dtype=None)
    require_resolved("critic.model", use_remove_padding=False, compile_layers=True, param_dtype="bfloat16")
    cfg = role_configs_from_overrides(["data.train_files=t", f"{ARR}.model.path=/m"])
    assert AUTO not in _values(cfg).values()
    assert cfg == resolve_configs(_configs(total_steps=None), local_facts())[0]


def _sft_configs(*overrides: str):
    from fusedrl.config import compose_config, to_plain_dict
    from fusedrl.sft_role_config import build_sft_role_configs

    plain = to_plain_dict(
        compose_config(
            ["data.train_files=t", "model.path=/m", *overrides], "sft_trainer", validate_config=False
        )
    )
    return build_sft_role_configs(plain, total_steps=5)


def test_sft_param_dtype():
    for facts, dtype in ((AMX_CPU, "bfloat16"), (AVX2_CPU, None), (CUDA_SDPA, "bfloat16")):
        resolved, chosen = resolve_configs(_sft_configs(), facts)
        assert resolved.model.fsdp_config.param_dtype == dtype
        assert chosen == {
            "model.fsdp_config.param_dtype": (
                dtype,
                "native bf16" if dtype else "no native bf16: the model dtype",
            )
        }
    assert resolve_configs(_sft_configs("model.fsdp_config.param_dtype=float32"), AMX_CPU)[1] == {}


def test_sft_validation_accepts_auto_and_names_bad_values(tmp_path):
    from fusedrl.config import ConfigError
    from fusedrl.trainer.sft_trainer import load_sft_config

    with pytest.raises(ConfigError) as info:
        load_sft_config(
            ["data.train_files=missing.parquet", "model.path=/m", "model.fsdp_config.param_dtype=bf61"]
        )
    assert "`model.fsdp_config.param_dtype`='bf61': use auto, null or one of " in str(info.value)
    assert "param_dtype`='auto'" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_sft_config(["data.train_files=missing.parquet", "model.path=/m"])
    assert "param_dtype" not in str(info.value)


def test_the_worker_resolves_before_building_and_reports(monkeypatch):
    """`DistributedWorker._resolve_auto_defaults` (called by `WorkerDict.init_roles` / `SFTWorker.init`
    after joining the group): the worker's config holds no auto afterwards, and `resolved_defaults` answers
    the driver."""
    import fusedrl.auto_defaults as ad
    from fusedrl.workers.distributed import DistributedWorker

    monkeypatch.setattr(ad, "group_facts", lambda: AMX_CPU)
    worker = DistributedWorker(_configs(), rank=0, world_size=1)
    assert worker.resolved_defaults() == {"settings": {}, "line": ""}  # before init
    worker._resolve_auto_defaults(["actor", "rollout"])
    assert AUTO not in _values(worker.config).values()
    answer = worker.resolved_defaults()
    assert answer["settings"] == {
        DTYPE_KEYS[0]: "bfloat16",
        f"{ARR}.model.use_remove_padding": True,
        f"{ARR}.model.compile_layers": True,
        f"{ARR}.rollout.sleep_level": 1,
    }
    assert answer["line"].startswith("fusedrl: auto defaults on CPU fake AMX: ")


def test_compile_layers_auto_stays_off_under_expert_parallelism():
    """A run where auto compiles (AMX CPU: bf16 compute, packed rows, a long run) does not with the actor's or
    the reference's experts spread over the workers (not run compiled: docs/moe.md)."""
    assert resolve_configs(_configs(), AMX_CPU)[0].model.compile_layers is True
    for role in ("actor", "ref"):
        key = f"{ARR}.{role}.fsdp_config.turbo_config.distributed.expert_parallel_size=2"
        resolved, chosen = resolve_configs(_configs(key), AMX_CPU)
        assert resolved.model.compile_layers is False
        assert chosen[f"{ARR}.model.compile_layers"] == (False, "expert parallelism")
