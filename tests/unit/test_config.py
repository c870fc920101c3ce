"""load_config / validate on real files: overrides land, verl keys exist, every problem is reported at once."""

from __future__ import annotations

import pytest

from fusedrl.config import ConfigError, load_config
from fusedrl.utils.hardware import native_bf16

# The vLLM check depends on the machine; the hf engine keeps these tests about the config alone.
HF = "actor_rollout_ref.rollout.name=hf"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from fusedrl.data.arithmetic import write_arithmetic_parquet
    from fusedrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("config_files")
    model = build_tiny_model(str(root / "model"))
    train, test = write_arithmetic_parquet(str(root / "data"), n_train=16, n_test=4, seed=0)
    return {"model": model, "train": train, "test": test, "root": str(root)}


@pytest.fixture
def base(files) -> list[str]:
    """The smallest valid command line."""
    return [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}", HF]


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    err = info.value
    assert str(len(err.problems)) in str(err).splitlines()[0]
    for p in err.problems:  # every problem is in the message
        assert p in str(err)
    return err.problems


def problem_naming(problems: list[str], key: str) -> str:
    hits = [p for p in problems if p.startswith(f"`{key}`")]
    assert len(hits) == 1, f"expected one problem about `{key}`, got {problems}"
    return hits[0]


# ---------------------------------------------------------------------- valid command lines


def test_valid_command_line_applies_overrides(files):
    cfg = load_config(
        [
            f"data.train_files={files['train']}",
            f"data.val_files={files['test']}",
            f"actor_rollout_ref.model.path={files['model']}",
            HF,
            "data.train_batch_size=4",
            "data.max_prompt_length=48",
            "data.max_response_length=16",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=3e-5",
            "algorithm.adv_estimator=rloo",
            "trainer.n_gpus_per_node=4",
            "trainer.total_epochs=3",
            "trainer.total_training_steps=5",
        ]
    )
    assert cfg.data.train_files == files["train"]
    assert cfg.data.val_files == files["test"]
    assert cfg.data.train_batch_size == 4
    assert cfg.data.max_prompt_length == 48
    assert cfg.data.max_response_length == 16
    assert cfg.actor_rollout_ref.model.path == files["model"]
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.rollout.n == 2
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 2
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-5)
    assert cfg.algorithm.adv_estimator == "rloo"
    assert cfg.trainer.n_gpus_per_node == 4
    assert cfg.trainer.nnodes == 1
    assert cfg.trainer.total_epochs == 3
    assert cfg.trainer.total_training_steps == 5


def test_verl_style_keys_exist_with_defaults(base):
    from omegaconf import OmegaConf

    cfg = load_config(base)
    for key in (
        "data.train_files",
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "actor_rollout_ref.model.path",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.optim.lr",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "algorithm.adv_estimator",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "trainer.total_epochs",
        "trainer.total_training_steps",
    ):
        parent, _, leaf = key.rpartition(".")
        assert leaf in OmegaConf.select(cfg.source, parent), key
    # Defaults from trainer/config/ppo_trainer.yaml.
    assert cfg.data.train_batch_size == 8
    # verl's defaults for the keys verl also has: PPO with a critic, one sample, no KL loss, validate first.
    assert cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False
    assert cfg.trainer.val_before_train is True
    # verl's bf16, kept where the CPU computes bf16 natively and switched to float32 where it does not
    # (fusedrl.cpu_dtype): this test runs on both kinds of machine.
    assert cfg.actor_rollout_ref.rollout.dtype == ("bfloat16" if native_bf16()[0] else "float32")
    assert cfg.actor_rollout_ref.actor.optim.weight_decay == 0.01
    assert cfg.data.truncation == "error" and cfg.data.filter_overlong_prompts is False
    assert cfg.trainer.total_training_steps is None


def test_list_of_train_files(files):
    cfg = load_config(
        [
            f"data.train_files=[{files['train']},{files['test']}]",
            f"actor_rollout_ref.model.path={files['model']}",
            HF,
        ]
    )
    assert list(cfg.data.train_files) == [files["train"], files["test"]]


def test_validate_can_be_skipped():
    cfg = load_config([HF], validate_config=False)
    assert cfg.actor_rollout_ref.rollout.name == "hf"


# ---------------------------------------------------------------------- problems, all at once


def test_missing_required_keys_reported_together():
    problems = problems_of([HF])
    assert len(problems) == 2, problems
    for key in ("data.train_files", "actor_rollout_ref.model.path"):
        assert "required" in problem_naming(problems, key)


def test_several_problems_reported_in_one_error(files):
    # world = 2 x 1 = 2; 3 prompts x 3 samples = 9 does not divide by 2; mini 2 does not divide 3;
    # mini x n = 6 does divide by 2, so exactly five problems.
    missing = f"{files['root']}/no_such_train.parquet"
    overrides = [
        f"data.train_files={missing}",
        f"actor_rollout_ref.model.path={files['model']}",
        HF,
        "algorithm.adv_estimator=not_an_estimator",
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=3",
        "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.loss_agg_mode=not_a_mode",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    err = info.value
    message = str(err)
    assert len(err.problems) == 5, err.problems
    assert message.startswith("5 config problem(s):")
    for key in (
        "data.train_files",
        "algorithm.adv_estimator",
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.loss_agg_mode",
    ):
        assert f"`{key}`" in message, key
    assert missing in problem_naming(err.problems, "data.train_files")
    assert "not_an_estimator" in problem_naming(err.problems, "algorithm.adv_estimator")
    assert "grpo" in problem_naming(err.problems, "algorithm.adv_estimator")  # lists the known ones
    divisible = problem_naming(err.problems, "data.train_batch_size")
    assert "9" in divisible and "2 workers" in divisible
    assert "not_a_mode" in problem_naming(err.problems, "actor_rollout_ref.actor.loss_agg_mode")
    mini = problem_naming(err.problems, "actor_rollout_ref.actor.ppo_mini_batch_size")
    assert "does not divide" in mini and "=3" in mini


def test_model_path_without_config_json(files, tmp_path):
    problems = problems_of(
        [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={tmp_path}", HF]
    )
    assert len(problems) == 1
    assert "config.json" in problem_naming(problems, "actor_rollout_ref.model.path")


def test_missing_val_file(base, files):
    problems = problems_of([*base, f"data.val_files={files['root']}/nope.parquet"])
    assert len(problems) == 1
    assert "nope.parquet" in problem_naming(problems, "data.val_files")


def test_typo_in_override_key_suggests_the_real_key(base):
    problems = problems_of([*base, "data.train_batch_sise=4"])
    assert len(problems) == 1
    problem = problem_naming(problems, "data.train_batch_sise")
    assert "unknown key" in problem
    assert "`data.train_batch_size`" in problem


def test_unknown_key_without_close_match_suggests_plus(base):
    problem = problem_naming(problems_of([*base, "zzz.qqq=1"]), "zzz.qqq")
    assert "+key=value" in problem


def test_new_key_with_plus_is_accepted(base):
    cfg = load_config([*base, "+trainer.my_note=hello"])
    assert cfg.source.trainer.my_note == "hello"  # a new key: in the composed config, not the typed sections


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimator_accepts_one_sample_as_verl(base, estimator):
    # verl runs GRPO / RLOO with n=1 (a one-sample group: baseline 0, std 1); so does fusedrl.
    cfg = load_config([*base, f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"])
    assert cfg.actor_rollout_ref.rollout.n == 1


def test_gae_allows_single_sample(base):
    cfg = load_config([*base, "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1"])
    assert cfg.actor_rollout_ref.rollout.n == 1


def test_rollout_name_hf_passes(base):
    assert load_config(base).actor_rollout_ref.rollout.name == "hf"


def test_rollout_name_unknown_fails(base):
    problems = problems_of([*base, "actor_rollout_ref.rollout.name=foo"])
    assert len(problems) == 1
    assert "'foo'" in problem_naming(problems, "actor_rollout_ref.rollout.name")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.train_batch_size=0", "data.train_batch_size"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=0", "actor_rollout_ref.actor.ppo_mini_batch_size"),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ),
        ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node"),
        ("data.truncation=cut", "data.truncation"),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=nope",
            "actor_rollout_ref.actor.policy_loss.loss_mode",
        ),
        ("actor_rollout_ref.actor.kl_loss_type=k9", "actor_rollout_ref.actor.kl_loss_type"),
        ("actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr"),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3",  # does not divide 2 workers
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
        ),
        ("actor_rollout_ref.rollout.sleep_level=3", "actor_rollout_ref.rollout.sleep_level"),
        ("actor_rollout_ref.model.attn_implementation=flash", "actor_rollout_ref.model.attn_implementation"),
        ("critic.model.attn_implementation=xformers", "critic.model.attn_implementation"),
        ("actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.temperature"),
        ("trainer.logger=[console,mlflow]", "trainer.logger"),
        ("trainer.step_timeout_s=-1", "trainer.step_timeout_s"),
        ("trainer.preemption_save_timeout_s=soon", "trainer.preemption_save_timeout_s"),
    ],
)
def test_single_bad_value_names_its_key(base, override, key):
    problems = problems_of([*base, override])
    assert len(problems) == 1, problems
    problem_naming(problems, key)


def test_param_offload_with_the_hf_rollout_is_a_config_error(base):
    problems = problems_of(
        [*base, "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.fsdp_config.param_offload=true"]
    )
    assert len(problems) == 1, problems
    problem_naming(problems, "actor_rollout_ref.actor.fsdp_config.param_offload")


def test_tensor_parallel_rollout_must_divide_the_workers_and_use_vllm(base):
    tp2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    problem_naming(problems_of([*base, tp2]), "actor_rollout_ref.rollout.tensor_model_parallel_size")  # hf
    cfg = load_config([*base, tp2, "actor_rollout_ref.rollout.name=vllm"])  # 2 workers, one TP=2 engine
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


def test_non_numeric_batch_size_is_a_config_error(base):
    problem_naming(problems_of([*base, "data.train_batch_size=abc"]), "data.train_batch_size")


# ---------------------------------------------------------------------- main_ppo


def _assert_exit_2_without_ray(capsys, argv: list[str], keys: list[str], monkeypatch) -> str:
    import ray

    from fusedrl.trainer import main_ppo

    def no_training(*args, **kwargs):  # pragma: no cover - only hit on a regression
        raise AssertionError("main() went on to start training despite config problems")

    monkeypatch.setattr(main_ppo, "run_ppo", no_training)
    was_initialized = ray.is_initialized()
    assert main_ppo.main(argv) == 2
    captured = capsys.readouterr()
    assert not ray.is_initialized()
    assert not was_initialized
    assert captured.out == ""
    assert "config problem(s)" in captured.err
    for key in keys:
        assert f"`{key}`" in captured.err, key
    return captured.err


def test_main_bad_args_exit_2_without_ray(capsys, monkeypatch):
    err = _assert_exit_2_without_ray(
        capsys,
        ["actor_rollout_ref.rollout.name=foo", "algorithm.adv_estimator=nope", "data.train_batch_size=16"],
        [
            "data.train_files",
            "actor_rollout_ref.model.path",
            "actor_rollout_ref.rollout.name",
            "algorithm.adv_estimator",
        ],
        monkeypatch,
    )
    assert err.startswith("fusedrl: 4 config problem(s):")


def test_main_typo_exit_2_without_ray(capsys, monkeypatch, base):
    err = _assert_exit_2_without_ray(
        capsys, [*base, "data.train_batch_sise=4"], ["data.train_batch_sise"], monkeypatch
    )
    assert "data.train_batch_size" in err


def test_unknown_key_reported_with_other_problems(tmp_path):
    from fusedrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(["data.train_batch_sise=4", "actor_rollout_ref.rollout.name=hf"])
    text = str(err.value)
    assert "data.train_batch_size" in text  # the suggestion
    assert "data.train_files" in text and "actor_rollout_ref.model.path" in text  # and the missing keys


def test_unparsable_override_is_a_config_error():
    from fusedrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="command line"):
        load_config(["data.train_files=[a,b", "actor_rollout_ref.rollout.name=hf"])


def test_bare_string_logger_is_one_logger(base):
    from fusedrl.config import load_config, logger_names

    cfg = load_config([*base, "trainer.logger=console"])
    assert logger_names(cfg) == ["console"]


def test_unwritable_checkpoint_dir_is_a_config_error(base, tmp_path):
    """Checked at start-up, not at the first save hours later (a file where a folder should be: unwritable
    whoever runs it; a read-only mount is covered by tests/reliability/test_full_disk.py)."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    bad = f"trainer.default_local_dir={blocker}/ckpt"
    problem = problem_naming(problems_of([*base, "trainer.save_freq=1", bad]), "trainer.default_local_dir")
    assert str(blocker) in problem and "not a folder" in problem and "save_freq=-1" in problem
    load_config([*base, "trainer.save_freq=-1", bad])  # no checkpoints: nothing to write there
    load_config(
        [*base, "trainer.save_freq=1", f"trainer.default_local_dir={tmp_path}/new/ckpt"]
    )  # created later
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == [blocker]  # the probe left nothing


def test_multi_turn_problems_reported_together(base):
    mt = "actor_rollout_ref.rollout.multi_turn"
    problems = problems_of(
        [
            *base,  # rollout.name=hf: agent loops need the vLLM engine
            f"{mt}.enable=true",
            f"{mt}.tool_response_truncate_side=top",
            f"{mt}.tool_config_path=/nonexistent/tools.yaml",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "trainer.n_gpus_per_node=2",
        ]
    )
    assert "tensor_model_parallel_size=1 only" in " ".join(problems)
    enable = [p for p in problems if p.startswith(f"`{mt}.enable`")]
    assert len(enable) == 2 and "needs an engine that takes requests one at a time" in enable[0]
    assert "rollout.name=vllm or fake" in enable[0] and "rollout.name=hf generates whole batches" in enable[0]
    assert "left, right or middle" in problem_naming(problems, f"{mt}.tool_response_truncate_side")
    assert not any("tokenization_check" in p for p in problems)  # the default "off" is not a boolean
    assert "does not exist" in problem_naming(problems, f"{mt}.tool_config_path")


# ---------------------------------------------------------------------- verl parity values
RC = "algorithm.rollout_correction"


def test_verl_rollout_correction_values_load(base):
    cfg = load_config(
        [
            *base,
            f"{RC}.rollout_rs='token_k1,seq_max_k2'",  # quoted, as Hydra (and verl) need
            f"{RC}.rollout_rs_threshold='0.5_2.0,0.01'",
            f"{RC}.bypass_mode=true",
            f"{RC}.loss_type=reinforce",
            f"{RC}.rollout_is=token",
        ]
    )
    assert cfg.algorithm.rollout_correction.loss_type == "reinforce"


@pytest.mark.parametrize(
    ("overrides", "key", "hint"),
    [
        ([f"{RC}.loss_type=reinforce"], f"{RC}.loss_type", "bypass_mode`=true"),
        ([f"{RC}.loss_type=dpo"], f"{RC}.loss_type", "ppo_clip or reinforce"),
        ([f"{RC}.rollout_rs=token_k9", f"{RC}.rollout_rs_threshold=2.0"], f"{RC}.rollout_rs", "seq_max_k2"),
        (
            [f"{RC}.rollout_rs=seq_max_k3", f"{RC}.rollout_rs_threshold=0.5_2.0"],
            f"{RC}.rollout_rs_threshold",
            "upper",
        ),
        (["actor_rollout_ref.actor.loss_scale_factor=0"], "actor_rollout_ref.actor.loss_scale_factor", "> 0"),
        (["algorithm.adv_estimator=gdpo"], "algorithm.gdpo_reward_keys", "+algorithm.gdpo_reward_keys="),
        (
            [
                "algorithm.adv_estimator=gdpo",
                "+algorithm.gdpo_reward_keys=[acc,fmt]",
                "algorithm.gdpo_reward_weights=[1.0]",
            ],
            "algorithm.gdpo_reward_weights",
            "one weight per",
        ),
    ],
)
def test_verl_parity_bad_values_name_key_and_fix(base, overrides, key, hint):
    problems = problems_of([*base, *overrides])
    assert hint in problem_naming(problems, key), problems


def test_gdpo_keys_with_plus_as_verl_writes_them(base):
    cfg = load_config(
        [*base, "algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]"]
    )
    assert list(cfg.algorithm.gdpo_reward_keys) == ["accuracy_reward", "format_reward"]
    assert cfg.critic.loss_scale_factor is None  # follows the actor's


def test_reward_section_problems_are_reported_before_ray_starts(tmp_path):
    """What the reward manager would refuse (its kind, the scoring pool's size and start method, the overlong
    buffer without DAPO) is reported by the config check with everything else, each naming its key."""
    model, train = tmp_path / "model", tmp_path / "train.parquet"
    model.mkdir()
    train.write_bytes(b"")
    problems = problems_of(
        [
            f"data.train_files={train}",
            f"actor_rollout_ref.model.path={model}",
            "reward_model.reward_manager=nope",
            "reward_model.num_workers=-1",
            "reward_model.mp_context=thread",
            "reward_model.overlong_buffer.enable=true",
        ]
    )
    for key in ("reward_model.reward_manager", "reward_model.num_workers", "reward_model.mp_context"):
        assert sum(key in p for p in problems) >= 1, (key, problems)
    assert any("overlong_buffer.enable=true" in p for p in problems), problems
