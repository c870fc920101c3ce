"""How fusedrl treats each key of verl's ``ppo_trainer`` config, so a verl command line runs unchanged.

Both of verl's layouts load: the one of verl commit b178a3cd5 (2026-01, ``reward_model.*``,
``custom_reward_function.*``, ``critic.model.fsdp_config.*``) and the one of verl main (``reward.*``,
``critic.fsdp.*``, ``trainer.v1.*``, ``model_engine``, ``ray_kwargs.ray_init.*``). A verl key is, in fusedrl:

- **in the YAML** (``trainer/config/ppo_trainer.yaml``): implemented or passed to the component it
  configures; the command line sets it as usual;
- **mapped** (`LAYOUT_RENAMES`, `LAYOUT_KEYS`, `RENAMED`, `translate`): verl's other name of a fusedrl
  key, rewritten before anything else. A command line that sets one setting under both names
  (``reward.reward_manager.name`` and ``reward_model.reward_manager``) is a problem naming the two keys;
- **accepted with no effect** (`NO_EFFECT`, each with the reason): the override is dropped, and the loader
  prints one console line naming every such key and why;
- **refused** (`REFUSED`, `rejected_value`): a value fusedrl cannot honour (Megatron, sglang, distillation,
  QAT, another config name) is a config problem, reported with the others before anything starts.

``+key`` overrides that nothing reads are kept and named in the same console line; ``+`` keys under the
open mappings (`OPEN_MAPPINGS`: reward keyword arguments, ``ray.init`` keyword arguments) are read. The
list of verl's keys lives in ``trainer/config/verl_ppo_trainer_keys.txt`` (``scripts/verl_keys.py``
writes it from a verl checkout); ``docs/verl_compat.md`` is generated from it and from this module
(``scripts/gen_verl_compat_docs.py``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# (glob over dotted keys, reason). The first matching pattern wins; keep the reasons short (they are
# printed on the console).
_PROFILING = "profiling is not built in (run torch.profiler or py-spy around main_ppo)"
_ULYSSES = "set the role's own ulysses_sequence_parallel_size (actor, critic, reward_model; the reference follows the actor)"
_ENTROPY_COMPILE = (
    "verl compiles its entropy function with it; fusedrl's is not compiled. To compile the decoder layers of "
    "the training passes, set actor_rollout_ref.model.compile_layers=true"
)
_FSDP_TUNING = "FSDP2 is applied per decoder layer with fixed settings"
_CRITIC_LORA = "the critic has no LoRA (actor LoRA runs with critic-free estimators)"
_KERNELS = "fused / Liger / tiled kernels are not used: Hugging Face modules as they are"
_PLACEMENT = "every role is fused into one worker per device slot"
_MULTIMODAL = "text-only: no image / video inputs"
_SAME_ENGINE = "fusedrl's vLLM engine runs in-process with fixed settings for this"
_MULTI_TURN = (
    "not a setting of fusedrl's multi-turn rollouts (they are implemented: multi_turn.enable, its keys in "
    "docs/agentic.md)"
)
_QAT = "quantization-aware training is not implemented (qat.enable=true is refused)"
_TURBO = "verl's FSDP-turbo engine settings: fusedrl's FSDP2 is applied per decoder layer with fixed settings"
_PAD = "micro-batches are packed or padded to their own longest row (no fixed pad length)"
_DISAGG = "no prefill / decode disaggregation (disaggregation.enabled=true is refused)"
_DISTILL = "on-policy distillation is not implemented (distillation.enabled=true is refused)"
_SKIP = "no rollout dump / replay (skip.*.enable=true is refused)"
_V1 = "fusedrl's async mode syncs weights after every update and bounds staleness at one update"
_RM_ENGINE = (
    "the reward model is a sequence classifier fused into the workers (no inference engine of its own)"
)
_MEGATRON_LORA = (
    "verl's Megatron-bridge LoRA section; fusedrl's LoRA (FSDP) is actor_rollout_ref.model.lora_rank / "
    "lora_alpha / target_modules / exclude_modules / lora_adapter_path (model.lora.rank > 0 is refused)"
)

NO_EFFECT: tuple[tuple[str, str], ...] = (
    # --- profiling, tracing, metrics export
    ("*.profiler.*", _PROFILING),
    ("*.profiler", _PROFILING),
    ("global_profiler.*", _PROFILING),
    ("actor_rollout_ref.rollout.trace.*", "rollout tracing is not built in"),
    ("actor_rollout_ref.rollout.prometheus.*", "no Prometheus exporter (use trainer.logger)"),
    ("ray_kwargs.timeline_json_file", "no Ray timeline dump"),
    # --- parallelism and FSDP tuning
    (
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
        "set actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    ),
    (
        "critic.model.fsdp_config.ulysses_sequence_parallel_size",
        "set critic.ulysses_sequence_parallel_size",
    ),
    (
        "actor_rollout_ref.ref.*ulysses_sequence_parallel_size",
        "the reference splits sequences as actor_rollout_ref.actor.ulysses_sequence_parallel_size says",
    ),
    ("*ulysses_sequence_parallel_size", _ULYSSES),
    ("*.fsdp_config.wrap_policy.*", _FSDP_TUNING),
    ("*.fsdp_config.offload_policy", _FSDP_TUNING),
    ("*.fsdp_config.reshard_after_forward", _FSDP_TUNING),
    ("*.fsdp_config.fsdp_size", "FSDP2 always shards over every worker (no hybrid sharding)"),
    ("*.fsdp_config.forward_prefetch", _FSDP_TUNING),
    ("*.fsdp_config.use_orig_params", "FSDP2 has no flat parameters (FSDP1's use_orig_params)"),
    ("*.fsdp_config.seed", "the seed is actor_rollout_ref.rollout.seed (identical init on every rank)"),
    ("*.fsdp_config.full_determinism", "no deterministic-algorithms switch"),
    ("*.fsdp_config.strategy", "always FSDP2"),
    ("*.fsdp_config.forward_only", "derived from the role (the reference never trains)"),
    ("*.fsdp_config.use_torch_compile", _ENTROPY_COMPILE),
    ("*.fsdp_config.entropy_*", "entropy is computed in one pass per micro-batch"),
    (
        "*.fsdp_config.dtype",
        "the compute dtype is fsdp_config.param_dtype (auto: bfloat16 where the device has native bf16, "
        "else model_dtype)",
    ),
    ("actor_rollout_ref.ref.fsdp_config.optimizer_offload", "the reference has no optimizer"),
    ("reward_model.model.fsdp_config.param_offload", "the reward model stays on the device"),
    ("*.strategy", "always FSDP2 (fsdp and fsdp2 both mean it; megatron is rejected)"),
    ("*.use_torch_compile", _ENTROPY_COMPILE),
    ("*entropy_checkpointing", "entropy is computed in one pass per micro-batch"),
    ("*entropy_from_logits_with_chunking", "entropy is computed in one pass per micro-batch"),
    ("actor_rollout_ref.hybrid_engine", _PLACEMENT),
    ("actor_rollout_ref.nccl_timeout", "process groups use a 30-minute timeout"),
    ("reward_model.enable_resource_pool", _PLACEMENT),
    ("reward_model.n_gpus_per_node", _PLACEMENT),
    ("reward_model.nnodes", _PLACEMENT),
    # --- model loading and kernels
    ("critic.model.lora_*", _CRITIC_LORA),
    ("critic.model.target_modules", _CRITIC_LORA),
    ("critic.model.exclude_modules", _CRITIC_LORA),
    (
        "actor_rollout_ref.rollout.layered_summon",
        "always layered: under LoRA the merged weights are computed and streamed one module at a time",
    ),
    (
        "actor_rollout_ref.rollout.load_format",
        "the engine loads model.path (the base weights under LoRA), then receives the actor's weights",
    ),
    ("*.use_shm", "models are read from model.path directly (no copy to /dev/shm)"),
    ("*.use_liger", _KERNELS),
    ("*.use_fused_kernels", _KERNELS),
    ("*.fused_kernel_options.*", _KERNELS),
    ("*.tiled_mlp.*", _KERNELS),
    ("*.enable_activation_offload", "use model.enable_gradient_checkpointing to save activation memory"),
    ("*.mtp.*", "multi-token prediction is not supported"),
    ("*.mtp", "multi-token prediction is not supported"),
    ("*.override_config", "the model's config.json is used as it is"),
    ("*.external_lib", "use algorithm.custom_modules to import user code"),
    ("*.trust_remote_code", "models load with transformers' built-in classes (no remote code)"),
    ("*.tokenizer_path", "the tokenizer is read from actor_rollout_ref.model.path"),
    ("actor_rollout_ref.model.hf_config_path", "the config is read from actor_rollout_ref.model.path"),
    ("actor_rollout_ref.model.custom_chat_template", "the tokenizer's own chat template renders prompts"),
    ("reward_model.model.input_tokenizer", "the reward model must share the policy's tokenizer"),
    # --- actor / critic details
    ("*.rollout_n", "derived from actor_rollout_ref.rollout.n"),
    ("critic.enable", "derived: the critic is built when algorithm.adv_estimator=gae"),
    ("*.shuffle", "mini-batches follow the balanced batch order (trainer.balance_batch)"),
    ("*.data_loader_seed", "mini-batches are not reshuffled"),
    (
        "*.checkpoint.*",
        "one synchronous checkpoint holds every role (see actor_rollout_ref.actor.checkpoint.save_contents)",
    ),
    ("actor_rollout_ref.actor.calculate_entropy", "entropy is always computed and logged"),
    (
        "actor_rollout_ref.actor.calculate_sum_pi_squared",
        "Σπ² is computed when the estimator needs it (optimal_token_baseline)",
    ),
    (
        "actor_rollout_ref.actor.sum_pi_squared_checkpointing",
        "Σπ² is computed without grad (nothing to save)",
    ),
    ("actor_rollout_ref.actor.use_prefix_grouper", "not implemented"),
    ("actor_rollout_ref.actor.freeze_vision_tower", _MULTIMODAL),
    ("*.router_replay.*", "MoE router replay is not implemented"),
    ("actor_rollout_ref.actor.use_remove_padding", "set actor_rollout_ref.model.use_remove_padding"),
    ("*.optim.optimizer", "always AdamW"),
    ("*.optim.optimizer_impl", "always torch.optim.AdamW"),
    ("*.optim.override_optimizer_config", "always torch.optim.AdamW with optim.lr / betas / weight_decay"),
    ("*.optim.clip_grad", "set actor_rollout_ref.actor.grad_clip / critic.grad_clip"),
    ("*.optim.total_training_steps", "derived from trainer.total_training_steps"),
    # --- rollout
    ("actor_rollout_ref.rollout.prompt_length", "derived from data.max_prompt_length"),
    ("actor_rollout_ref.rollout.response_length", "derived from data.max_response_length"),
    (
        "actor_rollout_ref.rollout.do_sample",
        "training rollouts always sample (val_kwargs.do_sample: validation)",
    ),
    ("actor_rollout_ref.rollout.ignore_eos", "generation stops at EOS"),
    ("actor_rollout_ref.rollout.calculate_log_probs", "the rollout's log-probs are always kept"),
    ("actor_rollout_ref.rollout.logprobs_mode", "always processed_logprobs (after temperature)"),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", "the engine never loads a tokenizer"),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", _SAME_ENGINE),
    ("actor_rollout_ref.rollout.scheduling_policy", _SAME_ENGINE),
    ("actor_rollout_ref.rollout.engine_kwargs.*", _SAME_ENGINE),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", "wake-up is staged already (weights, then KV cache)"),
    ("actor_rollout_ref.rollout.data_parallel_size", "one engine per tensor-parallel group of workers"),
    ("actor_rollout_ref.rollout.expert_parallel_size", "no expert parallelism"),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "no pipeline parallelism"),
    ("actor_rollout_ref.rollout.over_sample_rate", "every requested sample is generated"),
    (
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
        "verl's agent loops do not read it (its sglang-era check only warned); fusedrl's check is "
        "multi_turn.tokenization_check (strict raises at the first differing token)",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
        "fusedrl trains on exactly the sampled ids (verl's false, its default; true is refused)",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
        "verl's agent loops do not read it; samples per prompt are actor_rollout_ref.rollout.n",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
        "null only: verl's interactions (removed from verl main) are not run; a path is refused",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.function_tool_path",
        "null only: list function tools in multi_turn.tool_config_path (class_name: file.py:func); a path is refused",
    ),
    (
        "actor_rollout_ref.rollout.agent.agent_loop_config_path",
        "register loops with fusedrl.agent.register_agent_loop in a module of algorithm.custom_modules",
    ),
    (
        "actor_rollout_ref.rollout.agent.*",
        "fusedrl's agent loops run on each worker's in-process engine (no agent-loop workers or servers)",
    ),
    ("actor_rollout_ref.rollout.multi_turn.*", _MULTI_TURN),
    ("actor_rollout_ref.rollout.checkpoint_engine.*", "weights stream in place within each worker"),
    ("actor_rollout_ref.rollout.skip_rollout", "no rollout dump / replay"),
    ("actor_rollout_ref.rollout.skip_dump_dir", "no rollout dump / replay"),
    ("actor_rollout_ref.rollout.enable_rollout_routing_replay", "MoE router replay is not implemented"),
    ("actor_rollout_ref.rollout.quantization*", "the engine runs in rollout.dtype"),
    # --- data
    ("data.tokenizer", "the tokenizer is read from actor_rollout_ref.model.path"),
    ("data.train_max_samples", "every row of data.train_files is used"),
    ("data.val_max_samples", "every row of data.val_files is used"),
    ("data.reward_fn_key", "the scorer is chosen by each row's data_source"),
    (
        "data.tool_config_path",
        "tools are declared with actor_rollout_ref.rollout.multi_turn.tool_config_path",
    ),
    ("data.return_raw_input_ids", "prompts are tokenized once, with the policy's tokenizer"),
    ("data.return_full_prompt", "prompts are rendered on the driver; rewards get the decoded text"),
    ("data.dataloader_num_workers", "prompts are tokenized once at start-up"),
    ("data.filter_overlong_prompts_workers", "prompts are tokenized once at start-up"),
    ("data.image_*", _MULTIMODAL),
    ("data.video_key", _MULTIMODAL),
    ("data.return_multi_modal_inputs", _MULTIMODAL),
    ("data.validation_shuffle", "validation runs over the whole set in file order"),
    ("data.trust_remote_code", "models load with transformers' built-in classes (no remote code)"),
    ("data.custom_cls.*", "the dataset class is fusedrl.data.RLDataset"),
    ("data.sampler.*", "prompts are drawn by a seeded shuffle (data.shuffle, data.seed)"),
    ("data.datagen.*", "no dynamic data generation"),
    ("data.apply_chat_template_kwargs", "the chat template is applied with its defaults"),
    # --- reward
    (
        "reward_manager.*",
        "set reward.reward_manager.name (or reward_model.reward_manager): naive | batch | dapo",
    ),
    ("reward_model.reward_loop_*", "set reward_model.reward_manager / custom_reward_function"),
    ("reward_model.use_reward_loop", "rewards are scored on the driver (reward_model.num_workers processes)"),
    (
        "reward_model.launch_reward_fn_async",
        "rewards are scored on the driver (reward_model.num_workers processes)",
    ),
    ("reward_model.sandbox_fusion.*", "no code sandbox"),
    ("reward_model.rollout.*", "generative reward models are not implemented"),
    ("reward_model.micro_batch_size", "set reward_model.micro_batch_size_per_gpu"),
    ("reward_model.max_length", "the reward model scores prompt + response as generated"),
    ("reward_model.use_dynamic_bsz", "the reward model uses row micro-batches"),
    ("reward_model.forward_max_token_len_per_gpu", "the reward model uses row micro-batches"),
    ("reward_model.model.use_remove_padding", "the reward model runs padded batches"),
    ("reward_model.model.fsdp_config.*", _FSDP_TUNING),
    # --- algorithm
    ("algorithm.use_pf_ppo", "PF-PPO reweighting is not implemented"),
    ("algorithm.pf_ppo.*", "PF-PPO reweighting is not implemented"),
    # --- trainer
    ("trainer.rollout_data_dir", "generations are not dumped (trainer.log_val_generations prints samples)"),
    (
        "trainer.validation_data_dir",
        "generations are not dumped (trainer.log_val_generations prints samples)",
    ),
    (
        "trainer.val_only",
        "not implemented: run with trainer.total_training_steps=0 and val_before_train=true",
    ),
    ("trainer.esi_redundant_time", "no elastic-instance handling"),
    ("trainer.default_hdfs_dir", "checkpoints go to trainer.default_local_dir"),
    ("trainer.del_local_ckpt_after_load", "checkpoints are kept (trainer.max_actor_ckpt_to_keep)"),
    ("trainer.max_critic_ckpt_to_keep", "one checkpoint holds every role: trainer.max_actor_ckpt_to_keep"),
    ("trainer.ray_wait_register_center_timeout", "workers register directly with the driver"),
    ("trainer.device", "the device is detected (CUDA when present, else CPU)"),
    ("trainer.use_legacy_worker_impl", "one worker implementation"),
    # --- verl main's keys (2026-08)
    ("*.qat.*", _QAT),
    ("*.qat", _QAT),
    ("*.fsdp_config.turbo_config.*", _TURBO),
    ("*pad_to_length*", _PAD),
    ("*entropy_from_logits_chunk_size", "entropy is computed in one pass per micro-batch"),
    (
        "*.optim.zero_indexed_step",
        "the scheduler counts steps from 0 (warmup starts at lr x 1 / warmup steps)",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.dro_beta",
        "read by verl's DRO loss mode, which fusedrl does not have",
    ),
    ("actor_rollout_ref.model.lora.*", _MEGATRON_LORA),
    ("critic.model.lora.*", _CRITIC_LORA),
    ("critic.model.hf_config_path", "the config is read from critic.model.path"),
    ("critic.model.custom_chat_template", "the critic scores the actor's tokens (no chat template)"),
    ("actor_rollout_ref.rollout.disaggregation.*", _DISAGG),
    ("actor_rollout_ref.rollout.full_determinism", "no deterministic-algorithms switch"),
    ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", "no MoE load-balance metrics"),
    (
        "actor_rollout_ref.rollout.n_gpus_per_node",
        "read only with actor_rollout_ref.rollout.nnodes > 0 (a rollout pool of its own: trainer.placement)",
    ),
    (
        "algorithm.filter_groups.max_inflight_gen_batches",
        "dynamic sampling runs one generation round at a time",
    ),
    ("data.audio_key", _MULTIMODAL),
    ("data.mm_processor_kwargs", _MULTIMODAL),
    ("*function_tool_path", "tools are declared with actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    ("reward.reward_manager.source", "register: fusedrl's registered managers naive / batch / dapo"),
    ("reward.reward_manager.module.path", "null: no custom reward-manager class"),
    ("trainer.v1.sampler.custom_sampler.path", "null: no custom sampler"),
    ("reward.reward_manager.module.name", "read only with reward.reward_manager.source=importlib (refused)"),
    ("reward.reward_model.rollout.*", _RM_ENGINE),
    ("reward.reward_model.rollout", _RM_ENGINE),
    ("sandbox_fusion.*", "no code sandbox"),
    ("distillation.*", _DISTILL),
    ("skip.*", _SKIP),
    (
        "trainer.use_v1",
        "one trainer: trainer.v1.trainer_mode picks synchronous or one-step-off async training",
    ),
    ("trainer.v1.sync", "the synchronous trainer has no settings"),
    ("trainer.v1.colocate_async.*", "trainer.v1.trainer_mode=colocate_async is refused"),
    (
        "trainer.v1.separate_async.num_warmup_batches",
        "one batch is generated ahead (async_training.max_staleness=1)",
    ),
    ("trainer.v1.separate_async.parameter_sync_step", _V1),
    ("trainer.v1.separate_async.hybrid_rollout.*", "trainer GPUs are not lent to generation"),
    ("trainer.v1.sampler.max_off_policy_*", _V1),
    (
        "trainer.v1.sampler.sync_refill_failed_groups",
        "groups are never dropped for staleness (bounded at one update)",
    ),
    ("trainer.v1.sampler.sampler_kwargs", "read only with trainer.v1.sampler.custom_sampler.path (refused)"),
    (
        "trainer.v1.sampler.custom_sampler.name",
        "read only with trainer.v1.sampler.custom_sampler.path (refused)",
    ),
    ("transfer_queue.*", "batches move through Ray's object store"),
)


# verl main's layout -> the older one fusedrl's YAML follows. A key under the first prefix is read as the
# same key under the second, then classified as that key is (the console and problems name the key as given).
LAYOUT_RENAMES: tuple[tuple[str, str], ...] = (
    ("critic.fsdp.", "critic.model.fsdp_config."),
    ("reward.custom_reward_function.", "custom_reward_function."),
    ("reward.reward_kwargs.", "reward_model.reward_kwargs."),
    ("reward.sandbox_fusion.", "reward_model.sandbox_fusion."),
    ("ray_kwargs.ray_init.", "trainer.ray_init."),
)
LAYOUT_KEYS: dict[str, str] = {
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.num_workers": "reward_model.num_workers",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes": "reward_model.nnodes",
}

# verl key -> fusedrl key it sets (same meaning, another name).
RENAMED: dict[str, str] = {
    "ray_kwargs.ray_init.num_cpus": "trainer.ray_num_cpus",
    # verl's loop names (single_turn_agent, tool_agent) are loop names in fusedrl too
    "actor_rollout_ref.rollout.agent.default_agent_loop": "actor_rollout_ref.rollout.multi_turn.default_agent_name",
    "reward_model.reward_kwargs.max_resp_len": "reward_model.overlong_buffer.max_resp_len",
}

# verl's DAPO scripts pass the overlong shaping as extra reward keyword arguments.
_OVERLONG_PREFIX = "reward_model.reward_kwargs.overlong_buffer_cfg."
_OVERLONG_KEYS = {"enable": "enable", "len": "len", "penalty_factor": "penalty_factor"}
_OVERLONG_NO_EFFECT = {
    "log": "the overlong penalty is always logged (reward/overlong_penalty)",
}

# Open mappings whose `+key` entries are read by fusedrl: keyword arguments of every scoring call, of
# ray.init (each name checked against ray.init's parameters before Ray starts).
OPEN_MAPPINGS = ("reward_model.reward_kwargs.", "trainer.ray_init.")

# Engines verl selects with `model_engine=...` (a Hydra config group); fusedrl's is FSDP2 (verl's `dp`).
ENGINES = {"megatron": "Megatron", "veomni": "VeOmni", "torchtitan": "TorchTitan"}


def _truthy(v: str) -> bool:
    return v in ("true", "1", "yes", "on")


def _set(v: str) -> bool:
    return v not in ("", "null", "none", "~")


def _nonzero(v: str) -> bool:
    return _set(v) and v not in ("0", "0.0", "false")


# (glob over dotted keys, the values refused, when (for the docs), problem text). The first match decides.
REFUSED: tuple[tuple[str, Callable[[str], bool], str, str], ...] = (
    (
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
        _set,
        "a path",
        "verl's interactions (removed from verl main) are not supported. For a simulated user or environment "
        "subclass fusedrl.agent.Environment, register it with fusedrl.agent.register_environment in a module "
        "listed in algorithm.custom_modules and name it in the rows' agent_name (docs/agentic.md).",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.function_tool_path",
        _set,
        "a path",
        "not supported yet. List each function in the tool YAML instead "
        "(actor_rollout_ref.rollout.multi_turn.tool_config_path, `- class_name: /path/tools.py:my_function`; "
        "the schema comes from its type hints and docstring) and drop verl's @function_tool decorator.",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
        _truthy,
        "true",
        "fusedrl trains on exactly the ids the engine sampled and the observations rendered once (verl's "
        "false); re-rendering turns with the inference template is not supported. Drop the key or set false.",
    ),
    (
        "distillation.enabled",
        _truthy,
        "true",
        "on-policy distillation is not implemented in fusedrl (a separate feature); drop the distillation.* "
        "keys or set distillation.enabled=false.",
    ),
    (
        "skip.*.enable",
        _truthy,
        "true",
        "fusedrl does not dump or replay rollouts; every step generates. Drop the skip.* keys.",
    ),
    (
        "*qat.enable",
        _truthy,
        "true",
        "quantization-aware training is not implemented; drop the qat keys (the engine runs in rollout.dtype).",
    ),
    (
        "*disaggregation.enabled",
        _truthy,
        "true",
        "prefill / decode disaggregation is not supported (one in-process engine per worker); drop the key.",
    ),
    (
        "actor_rollout_ref.model.lora.rank",
        _nonzero,
        "> 0",
        "this is verl's Megatron-bridge LoRA section. For LoRA under FSDP set actor_rollout_ref.model.lora_rank "
        "(and lora_alpha, target_modules), as verl's FSDP scripts do.",
    ),
    (
        "critic.model.lora.rank",
        _nonzero,
        "> 0",
        "fusedrl's critic has no LoRA. Drop the key (actor LoRA runs with critic-free estimators such as grpo).",
    ),
    (
        "reward.reward_manager.source",
        lambda v: v != "register",
        "not register",
        "fusedrl's reward managers are the registered naive / batch / dapo; for custom scoring set "
        "reward.custom_reward_function.path and .name.",
    ),
    (
        "reward.reward_manager.module.path",
        _set,
        "a path",
        "custom reward-manager classes are not supported; for custom scoring set "
        "reward.custom_reward_function.path and .name.",
    ),
    (
        "trainer.v1.sampler.custom_sampler.path",
        _set,
        "a path",
        "custom samplers of verl's v1 trainer are not supported; drop the key.",
    ),
    (
        "trainer.v1.trainer_mode",
        lambda v: v == "colocate_async",
        "colocate_async",
        "fusedrl overlaps generation with training only with the rollout on a pool of its own: use "
        "trainer.v1.trainer_mode=separate_async (fusedrl's one-step-off mode, async_training.max_staleness=1, "
        "with actor_rollout_ref.rollout.nnodes / n_gpus_per_node or trainer.placement), or sync.",
    ),
    (
        "trainer.v1.trainer_mode",
        lambda v: v not in ("sync", "separate_async"),
        "another mode",
        "use sync or separate_async (colocate_async is refused).",
    ),
)

_TRAINER_MODES = {"sync": 0, "separate_async": 1}

# The docs' status of the keys `map_overrides` reads together (not one fusedrl key each).
COMBINED_STATUS: dict[str, tuple[str, str]] = {
    "trainer.v1.trainer_mode": (
        "maps to",
        "`async_training.max_staleness`: sync 0, separate_async 1 (one-step-off); colocate_async is refused",
    ),
    "actor_rollout_ref.rollout.nnodes": (
        "maps to",
        "`trainer.placement`: > 0 gives the rollout a pool of its own (nnodes x rollout.n_gpus_per_node); "
        "0 (verl's default): the rollout runs in the fused workers",
    ),
}


def verl_keys() -> list[str]:
    """Every leaf key of verl's ``ppo_trainer`` config (from ``verl_ppo_trainer_keys.txt``)."""
    from fusedrl.config import _config_dir

    path = Path(_config_dir()) / "verl_ppo_trainer_keys.txt"
    return [
        line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


def verl_revision() -> str:
    """The verl commit ``verl_ppo_trainer_keys.txt`` was written from (its header says)."""
    from fusedrl.config import _config_dir

    for line in (Path(_config_dir()) / "verl_ppo_trainer_keys.txt").read_text().splitlines():
        if line.startswith("# verl commit "):
            return line[len("# verl commit ") :].split(", written")[0]
    return "unknown"


def legacy_key(key: str) -> str:
    """``key`` in the layout fusedrl's YAML follows (verl main's new names rewritten; others unchanged)."""
    if key in LAYOUT_KEYS:
        return LAYOUT_KEYS[key]
    for new, old in LAYOUT_RENAMES:
        if key.startswith(new):
            return old + key[len(new) :]
    return key


def no_effect_reason(key: str) -> str | None:
    """Why ``key`` has no effect in fusedrl, or None when it is not in `NO_EFFECT`."""
    key = legacy_key(key)
    for pattern, reason in NO_EFFECT:
        if fnmatch.fnmatchcase(key, pattern):
            return reason
    return None


def translate(key: str) -> tuple[str | None, str | None]:
    """``(fusedrl key, None)`` for a verl route fusedrl maps onto its own key; ``(None, reason)`` for a
    route it accepts with no effect; ``(None, None)`` when ``key`` is neither."""
    if key in RENAMED:
        return RENAMED[key], None
    old = legacy_key(key)
    if old in RENAMED:
        return RENAMED[old], None
    if old.startswith(_OVERLONG_PREFIX):
        leaf = old[len(_OVERLONG_PREFIX) :]
        if leaf in _OVERLONG_KEYS:
            return f"reward_model.overlong_buffer.{_OVERLONG_KEYS[leaf]}", None
        return None, _OVERLONG_NO_EFFECT.get(
            leaf, "not an overlong-buffer setting (enable, len, penalty_factor)"
        )
    if old != key:
        return old, None
    return None, None


def refused_when(key: str) -> list[str]:
    """The values of ``key`` that `rejected_value` refuses, as the docs state them."""
    return [when for pattern, _, when, _ in REFUSED if fnmatch.fnmatchcase(key, pattern)]


def engine_of(key: str) -> str | None:
    """The engine a ``*.megatron.*`` / ``*.veomni.*`` / ``*.torchtitan.*`` key configures, else None."""
    return next((ENGINES[part] for part in key.split(".") if part in ENGINES), None)


def engine_problem(engine: str, how: str) -> str:
    return (
        f"{how}: {engine} is not supported; fusedrl trains with FSDP2 (verl's model_engine=dp). Drop "
        f"model_engine and the {engine} keys, and pass the FSDP keys (actor_rollout_ref.actor.fsdp_config.*, "
        "critic.fsdp.*) instead."
    )


def rejected_value(key: str, value: str) -> str | None:
    """A problem line when ``key=value`` asks for something fusedrl cannot run; None otherwise."""
    v = value.strip().strip("'\"").lower()
    old = legacy_key(key)
    for pattern, refused, _, text in REFUSED:
        if fnmatch.fnmatchcase(key, pattern) and refused(v):
            return f"`{key}`={value}: {text}"
    if old.endswith("strategy") and v.startswith("megatron"):
        return (
            f"`{key}`={value}: Megatron is not supported; fusedrl trains with FSDP2 "
            "(drop the key, or set it to fsdp / fsdp2)."
        )
    if old.endswith("strategy") and v not in ("fsdp", "fsdp2"):
        return f"`{key}`={value}: use fsdp or fsdp2 (both mean FSDP2 in fusedrl)."
    if old == "critic.model.lora_rank" and v not in ("0", "null", "none"):
        return (
            f"`{key}`={value}: fusedrl's critic has no LoRA. Drop the key (actor LoRA runs with critic-free "
            "estimators such as grpo), or set it to 0."
        )
    unset = v in ("", "null", "none", "~")
    if key == "actor_rollout_ref.rollout.multi_turn.interaction_config_path" and not unset:
        return (
            f"`{key}`={value}: verl's interactions (removed from verl main) are not supported. For a simulated "
            "user or environment subclass fusedrl.agent.Environment, register it with "
            "fusedrl.agent.register_environment in a module listed in algorithm.custom_modules and name it in "
            "the rows' agent_name (docs/agentic.md)."
        )
    if key == "actor_rollout_ref.rollout.multi_turn.function_tool_path" and not unset:
        return (
            f"`{key}`={value}: not supported yet. List each function in the tool YAML instead "
            "(actor_rollout_ref.rollout.multi_turn.tool_config_path, `- class_name: /path/tools.py:my_function`; "
            "the schema comes from its type hints and docstring) and drop verl's @function_tool decorator."
        )
    if key == "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template" and v in (
        "true",
        "1",
        "yes",
    ):
        return (
            f"`{key}`={value}: fusedrl trains on exactly the ids the engine sampled and the observations "
            "rendered once (verl's false); re-rendering turns with the inference template is not supported. "
            "Drop the key or set false."
        )
    if old == "actor_rollout_ref.rollout.name" and v in ("sglang", "trtllm"):
        return (
            f"`{key}`={value}: fusedrl's rollout engines are vllm (in-process) and hf; "
            f"{v} is not supported. Use actor_rollout_ref.rollout.name=vllm."
        )
    return None


def format_no_effect(entries: list[tuple[str, str]]) -> str:
    """One console line: every ignored key, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for key, reason in entries:
        by_reason.setdefault(reason, []).append(key)
    groups = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items())
    return f"fusedrl: accepted with no effect in fusedrl: {groups}"


def config_name_flags(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Drop verl's ``--config-name ppo_trainer`` / ``--config-path DIR`` flags (fusedrl has one PPO config);
    another config name is a problem."""
    kept: list[str] = []
    problems: list[str] = []
    it = iter(overrides)
    for ov in it:
        flag, eq, value = ov.partition("=")
        if flag not in ("--config-name", "--config-path", "-cn", "-cp"):
            kept.append(ov)
            continue
        if not eq:
            value = next(it, "")
        if flag in ("--config-name", "-cn"):
            name = value.strip("'\"").removesuffix(".yaml")
            engine = next((label for part, label in ENGINES.items() if part in name), None)
            if engine is not None:
                problems.append(
                    engine_problem(engine, f"--config-name {name}").replace(
                        "Drop model_engine",
                        "Use --config-name ppo_trainer (or drop the flag), drop model_engine",
                    )
                )
            elif name not in ("ppo_trainer", "_generated_ppo_trainer"):
                problems.append(
                    f"--config-name {name}: fusedrl's PPO entry point has one config, ppo_trainer. Drop the flag "
                    "and pass that config's keys on the command line."
                )
    return kept, problems


def map_overrides(
    base: DictConfig, overrides: list[str]
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """Map a verl command line onto fusedrl's keys: ``(overrides to compose, (key, why it has no effect)
    pairs, problems)``. See `fusedrl.verl_compat` for the classification."""
    from fusedrl.config import _all_keys

    known = set(_all_keys(base))
    kept: list[str] = []
    ignored: list[tuple[str, str]] = []
    problems: list[str] = []
    setters: dict[str, str] = {}  # fusedrl key -> the key of the command line that set it
    engine_keys: dict[str, list[str]] = {}  # engine -> its keys on the command line
    combined: dict[str, str] = {}  # keys read together after the loop (model_engine, v1 mode, rollout pool)

    def sets(target: str, key: str) -> None:
        """``key`` sets ``target``: a problem when another key of the command line set it already."""
        other = setters.setdefault(target, key)
        if other != key:
            problems.append(
                f"`{other}` and `{key}` both set `{target}` (verl's two layouts name the same setting); keep one."
            )

    for ov in overrides:
        if ov.startswith(("~", "hydra.")) or "=" not in ov:
            kept.append(ov)
            continue
        lhs, value = ov.split("=", 1)
        plus = lhs[: len(lhs) - len(lhs.lstrip("+"))]
        key = lhs[len(plus) :]
        if key in _COMBINED:
            combined[key] = value
            continue
        engine = engine_of(key)
        if engine is not None:
            engine_keys.setdefault(engine, []).append(key)
            continue
        bad = rejected_value(key, value)
        if bad:
            problems.append(bad)
            continue
        target, reason = translate(key)
        old = target if target is not None and target != key else key
        if target is not None and target in known:
            sets(target, key)
            kept.append(f"{target}={value}")
            continue
        if reason is None and old not in known:
            reason = next((r for r in map(no_effect_reason, _key_and_parents(old)) if r is not None), None)
        if reason is not None:
            ignored.append((key, reason))
            continue
        if old in known:
            sets(old, key)
            kept.append(
                f"{old}={value}" if plus == "+" or old != key else ov
            )  # `+` on a YAML key: just set it
            continue
        if plus or old.startswith(OPEN_MAPPINGS):
            sets(old, key)
            kept.append(f"+{old}={value}")
            if not old.startswith(OPEN_MAPPINGS):
                ignored.append((key, "added with +, but nothing in fusedrl reads it"))
            continue
        kept.append(f"{old}={value}")  # unknown: reported by _unknown_override_keys with a suggestion
    extra_kept, extra_problems = _combine(combined, engine_keys, ignored, sets)
    return [*kept, *extra_kept], ignored, [*problems, *extra_problems]


# Keys map_overrides reads together: verl's engine choice, v1 trainer mode and the rollout's own pool.
_COMBINED = (
    "model_engine",
    "trainer.v1.trainer_mode",
    "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node",
)


def _combine(
    values: dict[str, str],
    engine_keys: dict[str, list[str]],
    ignored: list[tuple[str, str]],
    sets: Callable[[str, str], None],
) -> tuple[list[str], list[str]]:
    """The overrides and problems of the `_COMBINED` keys and of engine-specific keys."""
    kept: list[str] = []
    problems: list[str] = []

    def plain(key: str) -> str:
        return values[key].strip().strip("'\"").lower()

    engine_named = None
    if "model_engine" in values:
        choice = plain("model_engine")
        if choice in ENGINES:
            engine_named = ENGINES[choice]
            problems.append(engine_problem(engine_named, f"`model_engine`={values['model_engine']}"))
        elif choice in ("dp", "fsdp", "fsdp2"):
            ignored.append(("model_engine", "dp is fusedrl's engine (FSDP2)"))
        else:
            problems.append(f"`model_engine`={values['model_engine']}: use dp (FSDP2, fusedrl's engine).")
    for engine, keys in engine_keys.items():
        if engine != engine_named:  # the model_engine problem covers its own engine's keys
            shown = ", ".join(f"`{k}`" for k in keys[:3]) + (
                f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            )
            problems.append(engine_problem(engine, f"{shown} ({engine} settings)"))

    if "trainer.v1.trainer_mode" in values:
        value = values["trainer.v1.trainer_mode"]
        bad = rejected_value("trainer.v1.trainer_mode", value)
        if bad:
            problems.append(bad)
        else:
            sets("async_training.max_staleness", "trainer.v1.trainer_mode")
            kept.append(f"async_training.max_staleness={_TRAINER_MODES[plain('trainer.v1.trainer_mode')]}")

    nnodes_key, slots_key = "actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node"
    own_pool = False
    if nnodes_key in values:
        try:
            nnodes = int(plain(nnodes_key))
        except ValueError:
            problems.append(
                f"`{nnodes_key}`={values[nnodes_key]}: use an integer (0: the rollout shares the fused workers)."
            )
            nnodes = 0
        if nnodes > 0:  # verl's standalone rollout: fusedrl's rollout pool of its own (trainer.placement)
            own_pool = True
            slots = values.get(slots_key, "${trainer.n_gpus_per_node}")
            sets("trainer.placement.pools", nnodes_key)
            sets("trainer.placement.roles", nnodes_key)
            kept.append(
                f"trainer.placement.pools={{rollout: {{nnodes: {nnodes}, n_gpus_per_node: {slots}}}}}"
            )
            kept.append("trainer.placement.roles={rollout: rollout}")
        else:
            ignored.append((nnodes_key, "0: the rollout runs in the fused workers"))
    if slots_key in values and not own_pool:
        ignored.append((slots_key, no_effect_reason(slots_key) or ""))
    return kept, problems


def _key_and_parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


# (verl's global micro-batch key, fusedrl's per-worker key it sets): verl divides the global size by the
# number of data-parallel workers, and so does fusedrl.
GLOBAL_MICRO_BATCHES = (
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    ),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ),
    ("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
    ("critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu"),
)


def apply_global_micro_batches(cfg: DictConfig) -> list[str]:
    """Set each ``*_per_gpu`` micro-batch size from its global verl key (when given): global / workers."""
    problems: list[str] = []
    try:
        workers = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    except (TypeError, ValueError):
        return problems  # reported by validate
    for global_key, per_gpu_key in GLOBAL_MICRO_BATCHES:
        value = OmegaConf.select(cfg, global_key, throw_on_missing=False)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"`{global_key}`={value!r}: must be an integer >= 1 (or null).")
            continue
        if workers < 1 or value % workers:
            problems.append(
                f"`{global_key}`={value}: a global micro-batch is split evenly over the {workers} workers "
                f"(trainer.n_gpus_per_node x trainer.nnodes); use a multiple of {workers}, or set "
                f"`{per_gpu_key}` instead."
            )
            continue
        parent, leaf = per_gpu_key.rsplit(".", 1)
        OmegaConf.select(cfg, parent)[leaf] = value // workers
    return problems
