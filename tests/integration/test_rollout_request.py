"""A generation call's request and answer in their compact form (`fusedrl.rollout_request`, issue 39 item 3)
sample what the padded rows with explicit seeds sampled, bit for bit.

Two fused workers (fake engine, float32) and a call of 3 rows, so the split pads the second engine's shard
with the first row again: `PPOTrainer.generate` (prompts as one ragged tensor, seeds computed on the workers,
responses and mask back as one ragged tensor) against the call the driver made before (`rollout_generate` of
``prompts`` / ``prompt_mask`` / ``sample_seeds`` split as a batch, answered whole): responses, masks and
log-probs equal; the kept rows give the reference the log-probs the sent rows give.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import fake_engine_grpo, started_trainer

pytestmark = pytest.mark.integration


def test_compact_request_samples_what_the_padded_rows_sampled(tiny_model_dir, arithmetic_data, tmp_path):
    overrides = fake_engine_grpo(tiny_model_dir, arithmetic_data[0], tmp_path)
    overrides += ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=3"]
    with started_trainer(overrides) as trainer:
        trainer.global_step = 3
        prompts = trainer.next_prompts()[:1]  # 3 rows on 2 engines: [row 0, row 1], [row 2, row 0 again]
        full = trainer.sampling
        # 5 tokens of the 8 columns (the tiny model samples no EOS): the answers' right padding crosses too.
        trainer.sampling = lambda validate: dataclasses.replace(full(validate), max_tokens=5)
        rollout, traffic = trainer.workers, trainer.workers.traffic
        before = dict(traffic.by_call)
        new = trainer.generate(prompts)
        calls = {k: v - before.get(k, 0) for k, v in traffic.by_call.items() if k.startswith("rollout_gen")}
        # One tensor out (the packed prompts); back: the packed responses and the log-probs.
        assert calls == {"rollout_generate_fields out": 1, "rollout_generate_fields back": 2}

        old, _ = trainer.generation_request(prompts, False, 0, trainer.global_step)
        assert torch.equal(old.sample_seeds, new.sample_seeds)
        sent = old.select_fields("prompts", "prompt_mask", "sample_seeds")
        sampling = trainer.sampling(False)
        trainer.sync_weights()  # the level-2 sleep after `generate` discarded the engine's weights
        rollout.run_all(lambda w: w.rollout_wake_up.remote(["weights", "kv_cache"]))
        shards = rollout.run_split(lambda w, s: w.rollout_generate.remote(s, sampling), sent)
        rollout.run_all(lambda w: w.rollout_sleep.remote())
        old = rollout.gather_batches(shards, sent)
        for name in ("responses", "response_mask", "rollout_log_probs", "prompts", "prompt_mask"):
            assert torch.equal(getattr(new, name), getattr(old, name)), name
            assert getattr(new, name).dtype == getattr(old, name).dtype, name
        assert new.response_mask.sum(-1).tolist() == [5, 5, 5] and new.responses.shape[1] == 8

        # The reference reads the prompts and responses the workers kept: the sent rows' log-probs.
        assert new.resident_rows is not None
        kept = trainer.compute_ref_log_probs(new)
        new.resident_rows = None
        assert torch.equal(kept.ref_log_probs, trainer.compute_ref_log_probs(new).ref_log_probs)
