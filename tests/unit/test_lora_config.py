"""LoRA config keys: problems reported before anything starts, each naming its key; targets that match no
module fail at model build naming the modules that exist; PEFT names map back to the base model's."""

from __future__ import annotations

import dataclasses

import pytest

from fusedrl.config import ConfigError, load_config

HF = "actor_rollout_ref.rollout.name=hf"
M = "actor_rollout_ref.model"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("lora_config")
    model = build_tiny_model(str(root / "model"))
    train, _ = write_arithmetic_parquet(str(root / "data"), n_train=8, n_test=2, seed=0)
    return {"model": model, "train": train}


@pytest.fixture
def base(files) -> list[str]:
    return [
        f"data.train_files={files['train']}",
        f"{M}.path={files['model']}",
        HF,
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
    ]


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    return info.value.problems


def test_lora_off_by_default_and_valid_lora_loads(base):
    assert load_config(base).actor_rollout_ref.model.lora_rank == 0
    cfg = load_config(
        [*base, f"{M}.lora_rank=8", f"{M}.lora_alpha=16", f"{M}.target_modules=[q_proj,v_proj]"]
    )
    assert list(cfg.actor_rollout_ref.model.target_modules) == ["q_proj", "v_proj"]


def test_every_lora_problem_is_reported_at_once(base, tmp_path):
    problems = problems_of(
        [
            *base,
            f"{M}.lora_rank=8",
            f"{M}.lora_alpha=0",
            f"{M}.target_modules=[]",
            f"{M}.lora_adapter_path={tmp_path}",  # a folder without adapter_config.json
            "algorithm.adv_estimator=gae",  # a critic, which has no LoRA
        ]
    )
    text = "\n".join(problems)
    assert f"`{M}.lora_alpha`=0" in text
    assert f"`{M}.lora_adapter_path`" in text and "adapter_config.json" in text
    assert "critic-free estimator" in text
    # with an adapter path, rank and targets come from the adapter: no "needs targets" problem then
    assert f"`{M}.target_modules`" not in text
    problems = problems_of([*base, f"{M}.lora_rank=8", f"{M}.target_modules=[]"])
    assert any(p.startswith(f"`{M}.target_modules`") and "all-linear" in p for p in problems)
    assert any(p.startswith(f"`{M}.lora_rank`") for p in problems_of([*base, f"{M}.lora_rank=-1"]))


def test_verl_critic_lora_is_refused_and_engine_keys_accepted(base):
    problems = problems_of([*base, "critic.model.lora_rank=8"])
    assert any("critic.model.lora_rank" in p and "no LoRA" in p for p in problems)
    notes: list[str] = []
    load_config(
        [
            *base,
            "actor_rollout_ref.rollout.load_format=safetensors",
            "actor_rollout_ref.rollout.layered_summon=true",
            f"{M}.use_shm=true",
            "critic.model.lora_rank=0",
        ],
        report=notes.append,
    )
    assert len(notes) == 1 and "layered_summon" in notes[0] and "load_format" in notes[0]


def _model_cfg(path: str, **lora):
    """``actor_rollout_ref.model`` as the workers get it (typed, the YAML's defaults) with LoRA keys set."""
    from fusedrl.config import role_configs_from_overrides

    base = role_configs_from_overrides(
        ["data.train_files=unused", f"actor_rollout_ref.model.path={path}"]
    ).model
    return dataclasses.replace(base, **lora)


def test_targets_matching_no_module_name_the_modules(files):
    from fusedrl.workers.fsdp import load_causal_lm
    from fusedrl.workers.lora import add_lora

    model_cfg = _model_cfg(
        files["model"], lora_rank=4, lora_alpha=8, target_modules=("query", "value"), exclude_modules=None
    )
    with pytest.raises(ValueError) as info:
        add_lora(load_causal_lm(files["model"], "float32"), model_cfg)
    msg = str(info.value)
    assert "target_modules" in msg
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert name in msg


def test_adapter_starts_as_the_base_model_and_names_map_back(files):
    import torch

    from fusedrl.lora import base_name, is_adapter_name
    from fusedrl.workers.fsdp import load_causal_lm
    from fusedrl.workers.lora import add_lora

    base = load_causal_lm(files["model"], "float32")
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    model_cfg = _model_cfg(
        files["model"], lora_rank=4, lora_alpha=8, target_modules="all-linear", exclude_modules=("down_proj",)
    )
    peft_model = add_lora(base, model_cfg)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert not any(
        "down_proj" in n or "lm_head" in n for n in trainable
    )  # excluded; all-linear skips the head
    mapped = {base_name(n) for n in peft_model.state_dict() if not is_adapter_name(n)}
    assert mapped == set(base_state)
    ids = torch.randint(3, 400, (2, 12))
    with torch.no_grad():
        with peft_model.disable_adapter():
            off = peft_model(input_ids=ids).logits
        on = peft_model(input_ids=ids).logits  # lora_B = 0: the same function
    assert torch.equal(on, off)


def test_reload_units_add_the_fused_siblings():
    from fusedrl.third_party.vllm.reload import reload_units

    got = reload_units(
        ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    )
    assert got == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.down_proj",
    }


def test_saved_adapter_round_trips_through_lora_adapter_path(files, tmp_path):
    """`save_adapter` writes a PEFT folder; `lora_adapter_path` starts a new actor from it (trainable)."""
    import torch

    from fusedrl.workers.fsdp import load_causal_lm
    from fusedrl.workers.lora import add_lora, save_adapter

    model_cfg = _model_cfg(
        files["model"], lora_rank=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), exclude_modules=None
    )
    trained = add_lora(load_causal_lm(files["model"], "float32"), model_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)  # a trained, non-zero adapter
    files_written = save_adapter(trained, str(tmp_path / "adapter"), rank=0)
    assert {f.rsplit("/", 1)[-1] for f in files_written} == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    resumed = add_lora(
        load_causal_lm(files["model"], "float32"),
        dataclasses.replace(model_cfg, lora_adapter_path=str(tmp_path / "adapter")),
    )
    assert [n for n, p in resumed.named_parameters() if p.requires_grad] == [
        n for n, p in trained.named_parameters() if p.requires_grad
    ]
    ids = torch.randint(3, 400, (2, 12), generator=gen)
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        with resumed.disable_adapter():
            assert not torch.allclose(resumed(input_ids=ids).logits, expected)  # the adapter matters
        assert torch.equal(resumed(input_ids=ids).logits, expected)


@pytest.fixture(scope="module")
def tied_model(files, tmp_path_factory) -> str:
    """The tiny model with ``tie_word_embeddings=true`` (SmolLM2's layout: the LM head is the embedding)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("lora_tied") / "model")
    shutil.copytree(files["model"], out)
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    config["tie_word_embeddings"] = True
    with open(f"{out}/config.json", "w") as f:
        json.dump(config, f)
    weights = load_file(f"{out}/model.safetensors")
    del weights["lm_head.weight"]  # the head is the embedding
    save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
    return out


def test_all_linear_leaves_a_tied_head_and_embedding_alone(tied_model):
    from fusedrl.workers.fsdp import load_causal_lm
    from fusedrl.workers.lora import add_lora, lora_layers

    base = load_causal_lm(tied_model, "float32")
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    model_cfg = _model_cfg(tied_model, lora_rank=4, lora_alpha=8, target_modules="all-linear")
    peft_model = add_lora(base, model_cfg)
    adapted = {name.rsplit(".", 1)[-1] for name in lora_layers(peft_model)}
    assert "q_proj" in adapted and not adapted & {"lm_head", "embed_tokens"}
    assert peft_model.get_output_embeddings().weight is peft_model.get_input_embeddings().weight


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_naming_a_tied_head_or_embedding_is_a_config_error(files, base, tied_model, module):
    tied = [o if not o.startswith(f"{M}.path=") else f"{M}.path={tied_model}" for o in base]
    lora = [f"{M}.lora_rank=4", f"{M}.target_modules=[q_proj,{module}]"]
    (problem,) = problems_of(tied + lora)
    assert f"`{M}.target_modules`" in problem and module in problem
    assert "tie_word_embeddings" in problem and "exclude_modules" in problem  # why, and the fix
    load_config(tied + lora + [f"{M}.exclude_modules=[{module}]"])  # excluded: accepted
    load_config(base + lora)  # an untied model may adapt its own head


def test_a_regex_reaching_the_tied_head_fails_at_build_naming_the_key(tied_model):
    from fusedrl.workers.fsdp import load_causal_lm
    from fusedrl.workers.lora import add_lora

    model_cfg = _model_cfg(tied_model, lora_rank=4, lora_alpha=8, target_modules=r".*(q_proj|lm_head)")
    with pytest.raises(ValueError) as info:
        add_lora(load_causal_lm(tied_model, "float32"), model_cfg)
    msg = str(info.value)
    assert "actor_rollout_ref.model.target_modules" in msg and "lm_head" in msg and "exclude_modules" in msg
