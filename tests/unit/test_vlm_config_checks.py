"""A vision-language model's run is checked before Ray starts (`fusedrl.vision_language_checks`): what the image
path has not been built for (compiled layers, Ulysses, agent loops, partial rollout, a rollout pool of its
own, a critic) is one problem each, naming the key, the model and the fix; the built configuration (GRPO, fused
pool, packed rows, gradient checkpointing, LoRA) has none, and a text model is not affected."""

from __future__ import annotations

import json

import pytest

from fusedrl.config import ConfigError, load_config

ARR = "actor_rollout_ref"
REFUSED = [
    (f"{ARR}.model.compile_layers=true", f"{ARR}.model.compile_layers", "compiled layers"),
    (
        f"{ARR}.actor.ulysses_sequence_parallel_size=2",
        f"{ARR}.actor.ulysses_sequence_parallel_size",
        "Ulysses",
    ),
    (f"{ARR}.rollout.multi_turn.enable=true", f"{ARR}.rollout.multi_turn.enable", "agent loops"),
    ("async_training.partial_rollout=true", "async_training.partial_rollout", "paused and resumed"),
    (
        "trainer.placement.pools={gen: {nnodes: 1, n_gpus_per_node: 1}}\ntrainer.placement.roles={rollout: gen}",
        "trainer.placement.roles",
        "rollout pool",
    ),
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator", "critic"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet

    root = tmp_path_factory.mktemp("vlm_checks")
    out = {}
    for name, model_type in (("vlm", "qwen2_5_vl"), ("text", "qwen2")):
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        out[name] = str(folder)
    out["train"], _ = write_arithmetic_parquet(str(root / "data"), n_train=8, n_test=2, seed=0)
    return out


def _base(folders: dict[str, str], model: str) -> list[str]:
    return [
        f"data.train_files={folders['train']}",
        f"{ARR}.model.path={folders[model]}",
        "algorithm.adv_estimator=grpo",
        f"{ARR}.rollout.n=2",
        "trainer.n_gpus_per_node=2",
        f"{ARR}.model.enable_gradient_checkpointing=true",
        f"{ARR}.model.use_remove_padding=true",
    ]


def _vlm_problems(overrides: list[str]) -> list[str]:
    try:
        load_config(overrides, report=lambda _line: None)
    except ConfigError as err:
        return [p for p in err.problems if "is a vision-language model" in p]
    return []


def test_the_built_image_configuration_passes(folders):
    assert _vlm_problems(_base(folders, "vlm")) == []
    assert _vlm_problems([*_base(folders, "vlm"), f"{ARR}.model.lora_rank=8"]) == []


@pytest.mark.parametrize(("override", "key", "named"), REFUSED, ids=[r[1] for r in REFUSED])
def test_what_the_image_path_lacks_is_refused_before_ray(folders, override, key, named):
    overrides = [*_base(folders, "vlm"), *override.split("\n")]
    (problem,) = _vlm_problems(overrides)
    assert problem.startswith(f"`{key}`=") and named in problem and folders["vlm"] in problem, problem
    assert (
        _vlm_problems([*_base(folders, "text"), *override.split("\n")]) == []
    )  # a text model: no such problem
