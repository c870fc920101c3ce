"""The model folder's chat template is checked before Ray starts (`fusedrl.chat_config`): a folder without
one, or whose assistant turn ends with a token the engine does not stop on, is a config problem naming the
folder and the fix. Also: LoRA (embedding not targeted) keeps tied embeddings tied."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from verl_lines import problems_of as _problems

from fusedrl.config import load_config


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("chat_config")
    model = build_tiny_model(str(root / "model"))
    train, _ = write_arithmetic_parquet(str(root / "data"), n_train=8, n_test=2, seed=0)
    return {"model": model, "train": train}


def _copy(files, tmp_path) -> str:
    out = str(tmp_path / "model")
    shutil.copytree(files["model"], out)
    return out


def _overrides(files, model: str) -> list[str]:
    return [
        f"data.train_files={files['train']}",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=hf",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
    ]


def _edit_json(path: str, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)


def _remove_template(model: str) -> None:
    jinja = os.path.join(model, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    cfg_path = os.path.join(model, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def test_a_model_with_a_template_ending_in_eos_passes(files):
    load_config(_overrides(files, files["model"]))


def test_a_model_without_a_chat_template_is_named_with_the_fix(files, tmp_path):
    from transformers import AutoTokenizer

    model = _copy(files, tmp_path)
    _remove_template(model)
    assert AutoTokenizer.from_pretrained(model).chat_template is None
    problems = _problems(_overrides(files, model))
    assert len(problems) == 1, problems
    assert model in problems[0] and "no chat template" in problems[0]
    assert "chat_template.jinja" in problems[0] and "tokenizer_config.json" in problems[0]


def test_a_template_ending_turns_with_a_non_stop_token_is_named_with_the_fix(files, tmp_path):
    from fusedrl.utils.tiny_model import CHAT_TEMPLATE

    model = _copy(files, tmp_path)
    _remove_template(model)
    template = CHAT_TEMPLATE.replace("'<|im_end|>'", "'<|endoftext|>'")  # end of turn: id 0, not eos
    with open(os.path.join(model, "chat_template.jinja"), "w") as f:
        f.write(template)
    problems = _problems(_overrides(files, model))
    assert len(problems) == 1, problems
    assert model in problems[0] and "<|endoftext|>" in problems[0] and "<|im_end|>" in problems[0]
    assert "generation_config.json" in problems[0] and "eos_token" in problems[0]

    # The fix the message names: make the engine stop on the template's end-of-turn token.
    _edit_json(os.path.join(model, "generation_config.json"), eos_token_id=[2, 0])
    load_config(_overrides(files, model))


def test_a_path_without_config_json_is_not_checked(tmp_path):
    from fusedrl.chat_config import chat_template_problems
    from fusedrl.config import load_config

    for path in ("some-org/some-hub-model", str(tmp_path)):
        run = load_config(
            ["data.train_files=t", f"actor_rollout_ref.model.path={path}"], validate_config=False
        )
        assert chat_template_problems(run) == []


def test_lora_keeps_tied_embeddings_tied_and_streams_the_head_as_the_embedding(tmp_path):
    """A tied Llama with LoRA on the attention projections (embedding and head not targeted): PEFT keeps
    lm_head and embed_tokens one parameter (frozen), and the merged stream the engine gets carries the same
    values under both names."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusedrl.config import role_configs_from_overrides
    from fusedrl.workers.lora import add_lora, merged_lora_stream

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    model_cfg = role_configs_from_overrides(
        ["data.train_files=unused", f"actor_rollout_ref.model.path={tmp_path}"]
    ).model
    model_cfg = dataclasses.replace(model_cfg, lora_rank=4, lora_alpha=8, target_modules="all-linear")
    peft = add_lora(base, model_cfg)
    head, embed = peft.get_output_embeddings().weight, peft.get_input_embeddings().weight
    assert head is embed and not embed.requires_grad
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)  # a trained adapter
    stream = dict(merged_lora_stream(peft, full=True))
    assert torch.equal(stream["lm_head.weight"], stream["model.embed_tokens.weight"])
    assert torch.equal(stream["model.embed_tokens.weight"], embed.detach())
    assert not any("lm_head" in n for n in stream if "lora" in n)
