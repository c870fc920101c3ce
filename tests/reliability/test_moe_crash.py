"""A GRPO run on the tiny random Qwen3-MoE (2 layers, 8 experts, top-2; `fusedrl.utils.tiny_moe`) with expert
parallelism (each of the 2 fused workers holds 4 of every layer's experts, tokens cross by all-to-all) SIGKILLed
in the middle of step 2 resumes from checkpoint 1 and equals an uninterrupted run: the same logged metrics at
every step and the same final checkpoint within float32 tolerance (issue 43: "kill-and-resume exact"). A resume
that loaded a rank's expert shard into the other rank, lost the router's or the experts' optimizer state, or
restored the engine's experts from the wrong step would train and sample other tokens at steps 2-4."""

from __future__ import annotations

import pytest
from driver_runs import driver_args, kill_mid_step_then_resume, metrics, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")

EP = [
    f"actor_rollout_ref.{role}.fsdp_config.turbo_config.distributed.expert_parallel_size=2"
    for role in ("actor", "ref")
] + ["actor_rollout_ref.rollout.calculate_log_probs=true"]  # the sync checked on every step, not only 1, 2


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    from fusedrl.utils.tiny_moe import build_tiny_moe_model

    return build_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)


def test_moe_expert_parallel_sigkill_mid_step_then_resume_equals_uninterrupted(
    tiny_moe_dir, arithmetic_data, reward_file, tmp_path
):
    reference = tmp_path / "reference"
    run_to_end(
        [*driver_args(tiny_moe_dir, arithmetic_data[0], reference, reward_file), *EP], tmp_path / "ref.log"
    )
    steps = metrics(reference)
    assert len(steps) == 4 and all(m["rollout/log_prob_abs_diff_max"] < 1e-4 for m in steps)  # engine synced
    out = tmp_path / "run"
    args = [*driver_args(tiny_moe_dir, arithmetic_data[0], out, reward_file), *EP]
    kill_mid_step_then_resume(args, out, reference, tmp_path, step=2)
