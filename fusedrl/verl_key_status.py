"""The status tables behind `fusedrl.verl_compat`: which verl keys fusedrl accepts with no effect (`NO_EFFECT`,
each with the reason printed on the console) and which values it refuses (`REFUSED`, each with the problem
text naming the fix). Data only; `fusedrl.verl_compat` applies them."""

from __future__ import annotations

from collections.abc import Callable

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
_MULTIMODAL = "only images are read, through the model folder's processor as saved (docs/multimodal.md)"
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
    ("*.strategy", "always FSDP2 (fsdp, fsdp2 and fsdp_turbo all mean it; megatron is rejected)"),
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
    ("actor_rollout_ref.rollout.logprobs_mode", "always processed_logprobs (after temperature)"),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", "the engine never loads a tokenizer"),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", _SAME_ENGINE),
    ("actor_rollout_ref.rollout.scheduling_policy", _SAME_ENGINE),
    ("actor_rollout_ref.rollout.engine_kwargs.*", _SAME_ENGINE),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", "wake-up is staged already (weights, then KV cache)"),
    ("actor_rollout_ref.rollout.data_parallel_size", "one engine per tensor-parallel group of workers"),
    (
        "actor_rollout_ref.rollout.expert_parallel_size",
        "1 only: the engine has no expert parallelism (other values are refused)",
    ),
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
    ("data.image_patch_size", "images are patched by the model folder's image processor"),
    ("data.video_key", "videos are not read (images only: docs/multimodal.md)"),
    ("data.return_multi_modal_inputs", "a vision-language model's rows always carry their images"),
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
    (
        "*turbo_config.distributed.expert_parallel_size",
        "1 only: the critic's experts are FSDP2-sharded with their decoder layer (other values are refused)",
    ),
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


def _truthy(v: str) -> bool:
    return v in ("true", "1", "yes", "on")


def _set(v: str) -> bool:
    return v not in ("", "null", "none", "~")


def _nonzero(v: str) -> bool:
    return _set(v) and v not in ("0", "0.0", "false")


def _not_one(v: str) -> bool:
    return _set(v) and v != "1"


# (glob over dotted keys, the values refused, when (for the docs), problem text). The first match decides.
REFUSED: tuple[tuple[str, Callable[[str], bool], str, str], ...] = (
    (
        "critic.*turbo_config.distributed.expert_parallel_size",
        _not_one,
        "other than 1",
        "the critic has no expert parallelism (the actor and the reference do: their "
        "fsdp_config.turbo_config.distributed.expert_parallel_size; docs/moe.md). Drop the key or set 1.",
    ),
    (
        "actor_rollout_ref.rollout.expert_parallel_size",
        _not_one,
        "other than 1",
        "the engine has no expert parallelism: vLLM runs the MoE layers tensor-parallel over "
        "actor_rollout_ref.rollout.tensor_model_parallel_size. Drop the key or set 1.",
    ),
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
