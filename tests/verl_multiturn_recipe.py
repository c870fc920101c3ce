"""verl's GSM8K multi-turn tool recipe as a fusedrl command line, on local tiny files.

Modelled on verl's ``examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn*.sh`` with the keys of its
``gsm8k_multiturn_grpo`` config passed on the command line (fusedrl has one config name), its tool YAML
(``gsm8k_tool_config.yaml``: ``class_name``, ``config: {type: native}``, an OpenAI function schema) and
rows shaped like verl's ``gsm8k_tool_agent_loop.py`` preprocessing (``agent_name: tool_agent``,
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``). Sizes are scaled to the tiny
model; the tool class is this repository's `verl_gsm8k_tool.Gsm8kAnswerTool`.
"""

from __future__ import annotations

from pathlib import Path

TOOL_NAME = "calc_gsm8k_reward"

TOOL_YAML = """\
tools:
  - class_name: "verl_gsm8k_tool.Gsm8kAnswerTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

SYSTEM = (
    "You are a math expert. Solve the question step by step, call the `calc_gsm8k_reward` tool with your "
    "answer, then give the final answer as `#### <answer>`."
)


def write_rows(path: Path, n: int, agent_names: tuple[str, ...] = ("tool_agent",)) -> str:
    """``n`` GSM8K-shaped rows; row k runs ``agent_names[k % len(agent_names)]``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for k in range(n):
        a, b = 3 + k, 4 + 2 * k
        answer = str(a * b)
        rows.append(
            dict(
                data_source="openai/gsm8k",
                prompt=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"A box holds {a} rows of {b} eggs. How many eggs?"},
                ],
                ability="math",
                reward_model={"style": "rule", "ground_truth": answer},
                extra_info={
                    "split": "train",
                    "index": k,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": answer}}},
                },
                agent_name=agent_names[k % len(agent_names)],
            )
        )
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def recipe(tmp: Path, model_dir: str, *, agent_names: tuple[str, ...] = ("tool_agent",)) -> list[str]:
    """The verl command line (without ``python -m ...main_ppo``), its files written under ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    tool_yaml = tmp / "gsm8k_tool_config.yaml"
    tool_yaml.write_text(TOOL_YAML)
    train = write_rows(tmp / "train.parquet", 4, agent_names)
    test = write_rows(tmp / "test.parquet", 2)
    return [
        # gsm8k_multiturn_grpo.yaml's keys (verl's --config-name), then the script's
        "data.max_prompt_length=256",
        "data.max_response_length=128",
        "data.return_raw_chat=True",
        "actor_rollout_ref.hybrid_engine=True",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=2",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "global_profiler.tool=torch_memory",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
        "actor_rollout_ref.rollout.multi_stage_wake_up=True",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "actor_rollout_ref.rollout.over_sample_rate=0.1",
        "actor_rollout_ref.rollout.mode=async",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console']",
        "trainer.project_name=multi-turn-grpo-tiny",
        "trainer.experiment_name=gsm8k-tool",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=20",
        "trainer.val_before_train=False",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "actor_rollout_ref.rollout.trace.token2text=False",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_yaml}",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=5",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=256",
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=middle",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=strict",
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=False",
        "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=null",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        "trainer.total_epochs=15",
    ]
