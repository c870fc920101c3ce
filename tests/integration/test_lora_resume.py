"""LoRA checkpoints on the real stack (slow): the checkpoint holds the adapter and its AdamW state only,
an interrupted-and-resumed LoRA run equals an uninterrupted one, and the merged export reproduces the
policy in vLLM too (in a child process: an engine owns its process's distributed state)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from support import FLOAT32_TRAINING, metrics_by_step, varied_score

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm")


def _config(model, data, out_dir, steps: int):
    from fusedrl.config import load_config

    return load_config(
        [
            f"data.train_files={data}",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.target_modules=all-linear",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.dtype=float32",
            *FLOAT32_TRAINING,  # float32 on both sides: the comparisons' tolerances assume it
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.n_gpus_per_node=1",
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={out_dir}",
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


def test_lora_resume_equals_uninterrupted_and_merged_export_runs_in_vllm(
    ray_cluster, tiny_model_dir, arithmetic_data, tmp_path
):
    train = arithmetic_data[0]
    export_dir = str(tmp_path / "merged")

    def export_and_score(trainer):
        trainer.export_hf(export_dir)
        return trainer.compute_log_probs(trainer.generate(trainer.next_prompts()))

    _, full_state, batch = _run(_config(tiny_model_dir, train, tmp_path / "a", 3), export_and_score)
    _run(_config(tiny_model_dir, train, tmp_path / "b", 2))
    with open(tmp_path / "b" / "global_step_2" / "actor" / "rank_0.json") as f:
        sidecar = json.load(f)
    saved = [e["name"] for e in sidecar["entries"]]
    assert sidecar["trainable_only"] and saved and all(".lora_" in n for n in saved)
    assert set(sidecar["optimizer"]["state"]) == set(saved)  # AdamW state of the adapters, nothing else
    resumed, resumed_state, _ = _run(_config(tiny_model_dir, train, tmp_path / "b", 3))
    assert resumed.global_step == 3

    a, b = metrics_by_step(tmp_path / "a"), metrics_by_step(tmp_path / "b")
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss"):
        assert a[3][key] == pytest.approx(b[3][key], abs=1e-5), key
    for name in full_state[0]:
        assert torch.allclose(full_state[0][name], resumed_state[0][name], atol=1e-5, rtol=0), name

    mask = batch.response_mask.bool()
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
