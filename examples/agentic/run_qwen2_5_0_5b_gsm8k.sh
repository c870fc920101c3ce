#!/usr/bin/env bash
# Agentic GRPO on GSM8K with a calculator tool, Qwen2.5-0.5B-Instruct: the GPU recipe.
# Each prompt runs the `tool` agent loop on the fused worker's own vLLM engine: the model may call
# calculator(expression) in Qwen's <tool_call> format (the tool list is rendered into the system prompt by
# the chat template), gets the result as a tool message, and answers after ####. Loss, KL and advantages
# cover the model's own tokens only (docs/agentic.md).
#
# Hardware: 1 GPU with 80 GB (or NGPUS=8 on one node). Time: not measured. Expected: not measured; this
#   recipe has not been run end to end with fusedrl (no GPU was available when it was written). Compare
#   val/test_score/openai/gsm8k with examples/grpo/run_qwen2_5_0_5b_gsm8k.sh (the same model without tools).
# Usage: bash examples/agentic/run_qwen2_5_0_5b_gsm8k.sh [key=value overrides]; env as in the grpo recipe.
#   `--print-overrides` prints the key=value list one per line and exits.
set -euo pipefail
RECIPE=agentic_calculator
RESPONSE_LEN="${RESPONSE_LEN:-1024}"   # sampled and tool tokens of all turns together
source "$(dirname "$0")/../common/gsm8k_gpu_setup.sh"
HERE="$(cd "$(dirname "$0")" && pwd)"

ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.norm_adv_by_std_in_grpo=true
    algorithm.custom_modules="[$HERE/calculator.py]"
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.rollout.multi_turn.enable=true
    actor_rollout_ref.rollout.multi_turn.default_agent_name=tool
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/calculator_tools.yaml"
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5
    actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=256
    actor_rollout_ref.rollout.multi_turn.tool_timeout_s=5
)

run_recipe "$@"
