"""Checkpoints on the real stack: an interrupted-and-resumed run equals an uninterrupted one, and the
exported Hugging Face folder reproduces the trained policy in transformers and in vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support import FLOAT32_TRAINING, metrics_by_step, varied_score

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")


def _config(model, data, out_dir, steps: int, extra=()):
    from fusedrl.config import load_config

    return load_config(
        [
            f"data.train_files={data}",
            f"actor_rollout_ref.model.path={model}",
            "data.train_batch_size=2",
            "data.max_response_length=12",
            "actor_rollout_ref.rollout.n=4",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            # A schedule that spans the interruption: warmup over steps 1-3, then cosine.
            "actor_rollout_ref.actor.optim.lr_warmup_steps=3",
            "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
            "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
            "trainer.n_gpus_per_node=2",
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={out_dir}",
            *extra,
        ]
    )


def _run(cfg, after_fit=None):
    from fusedrl.trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(cfg, compute_score=varied_score)
    try:
        trainer.init_workers()
        trainer.fit()
        state = trainer.workers.run_all(lambda w: w.actor_state.remote())
        extra = after_fit(trainer) if after_fit else None
    finally:
        trainer.close()
    return trainer, state, extra


def test_resume_equals_uninterrupted_and_export_reproduces_policy(
    ray_cluster, tiny_model_dir, arithmetic_data, tmp_path
):
    train = arithmetic_data[0]
    export_dir = str(tmp_path / "exported")

    def export_and_score(trainer):
        trainer.export_hf(export_dir)
        batch = trainer.compute_log_probs(trainer.generate(trainer.next_prompts()))
        return batch

    # Uninterrupted: 4 steps.
    _, full_state, batch = _run(_config(tiny_model_dir, train, tmp_path / "a", 4), export_and_score)
    # Interrupted: 2 steps (checkpoint at 2), then a new run of the same command resumes for 2 more.
    _run(_config(tiny_model_dir, train, tmp_path / "b", 2))
    assert sorted(os.listdir(tmp_path / "b")) == [
        "global_step_2",
        "latest_checkpointed_iteration.txt",
        "metrics.jsonl",
    ]
    resumed, resumed_state, _ = _run(_config(tiny_model_dir, train, tmp_path / "b", 4))
    assert resumed.global_step == 4

    a, b = metrics_by_step(tmp_path / "a"), metrics_by_step(tmp_path / "b")
    assert sorted(b) == [1, 2, 3, 4]  # the resumed run continued at step 3, not at 1
    # The learning-rate schedule continues across the resume: 0, 1/3, 2/3 of the rate in warmup, then the
    # cosine's first value (1.0 at the start of the decay).
    for step, factor in ((1, 0.0), (2, 1 / 3), (3, 2 / 3), (4, 1.0)):
        assert a[step]["actor/lr"] == pytest.approx(1e-3 * factor, rel=1e-6, abs=1e-12), step
        assert b[step]["actor/lr"] == pytest.approx(a[step]["actor/lr"], rel=1e-6, abs=1e-12), step
    for step in (3, 4):  # same prompts, same samples, same rewards after the resume
        for key in ("critic/score/mean", "response_length/mean", "prompt_length/mean"):
            assert a[step][key] == pytest.approx(b[step][key], abs=1e-6), (step, key)
    for rank_a, rank_b in zip(full_state, resumed_state):
        for name in rank_a:
            assert torch.allclose(rank_a[name], rank_b[name], atol=1e-5, rtol=0), name

    # The exported folder reproduces the trained policy: transformers ...
    from transformers import AutoModelForCausalLM

    from fusedrl.workers.logprob import batched_log_probs

    hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    mask = batch.response_mask.bool()
    hf_lp = batched_log_probs(hf, batch, temperature=1.0, micro_batch_size=8)
    assert float((hf_lp - batch.old_log_probs).abs()[mask].max()) < 1e-5

    # ... and vLLM (in a child process: an engine owns its process's distributed state).
    row = int(mask.sum(-1).argmax())
    prompt = batch.prompts[row][batch.prompt_mask[row].bool()].tolist()
    response = batch.responses[row][mask[row]].tolist()
    script = textwrap.dedent(
        f"""
        import json, os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model={export_dir!r}, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
        ids = {prompt + response!r}
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
        lps = out[0].prompt_logprobs
        print("RESULT", json.dumps([lps[i][ids[i]].logprob for i in range({len(prompt)}, len(ids))]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_lp = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[7:])
    expected = batch.old_log_probs[row][mask[row]]
    assert torch.allclose(torch.tensor(vllm_lp), expected, atol=1e-4), (vllm_lp, expected.tolist())
