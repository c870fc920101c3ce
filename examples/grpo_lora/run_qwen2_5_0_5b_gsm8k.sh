#!/usr/bin/env bash
# GRPO with LoRA on GSM8K with Qwen2.5-0.5B-Instruct: the GPU recipe, in verl's keys (a verl LoRA command
# line runs unchanged). Its CPU twin is run_tiny_cpu.sh here.
#
# Hardware: 1 GPU with 24 GB or more (the adapter's AdamW state is ~1% of full fine-tuning's), or 8 GPUs
#   on one node with NGPUS=8. Every GPU holds one fused worker: the PEFT actor under FSDP2 (its reference
#   is the same model with the adapters off) + vLLM.
# Time: not measured (this recipe has not yet been run end to end with fusedrl).
# Expected: as examples/grpo/run_qwen2_5_0_5b_gsm8k.sh, val/test_score/openai/gsm8k rises over the first
#   epoch; LoRA runs usually trail full fine-tuning slightly at the same number of steps.
# Before: pip install datasets wandb. Data and model as in examples/grpo (MODEL_PATH, DATA_DIR, NGPUS).
# Usage: bash examples/grpo_lora/run_qwen2_5_0_5b_gsm8k.sh [key=value overrides]
#   `--print-overrides` prints the key=value list one per line and exits (nothing is downloaded or run).
set -euo pipefail
RECIPE=grpo_lora
source "$(dirname "$0")/../common/gsm8k_gpu_setup.sh"

# algorithm: as examples/grpo (5 samples per prompt, std-normalised group advantages, k3 KL loss); the
# KL's reference is the base model, i.e. the actor with its adapters disabled
# LoRA: rank 64, alpha 32 on every linear layer but the LM head, and a learning rate ~10x full
# fine-tuning's (an adapter starting at B = 0 needs larger steps; left at 1e-6 it barely moves).
# The engine sleeps at level 1 (its weights stay on the host) so each sync streams only the merged
# adapted modules; at level 2 every sync re-streams the whole model. use_shm, load_format and
# layered_summon are verl's settings, accepted here (see docs/lora.md for what each means in fusedrl).
ALGORITHM=(
    algorithm.adv_estimator=grpo
    algorithm.norm_adv_by_std_in_grpo=true
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.model.lora_rank=64
    actor_rollout_ref.model.lora_alpha=32
    actor_rollout_ref.model.target_modules=all-linear
    actor_rollout_ref.model.use_shm=True
    actor_rollout_ref.actor.optim.lr=1e-5
    actor_rollout_ref.rollout.load_format=safetensors
    actor_rollout_ref.rollout.layered_summon=True
    actor_rollout_ref.rollout.sleep_level=1
)

run_recipe "$@"
