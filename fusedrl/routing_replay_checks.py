"""Config checks of the engine's recorded experts (``actor_rollout_ref.rollout.enable_rollout_routing_replay``,
verl's key, and fusedrl's ``rollout.record_routed_experts``; docs/moe.md), run by `fusedrl.config_checks.validate`
before Ray starts. Either key is accepted only where it takes effect as built and tested: a mixture-of-experts
text model, the vLLM engine, synchronous rollouts (single-turn or agent loops), and none of the training features the replayed
forward has not been run with. Each problem names the key and the fix."""

from __future__ import annotations

from typing import Any

from fusedrl.expert_parallel_checks import _model_config, num_experts

REPLAY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
RECORD = "actor_rollout_ref.rollout.record_routed_experts"


def routing_replay_problems(run: Any) -> list[str]:
    """The problems of routing replay / expert recording against the run (``run``: the typed sections;
    empty when both keys are off)."""
    switches = (
        (REPLAY, run.rollout.enable_rollout_routing_replay),
        (RECORD, run.rollout.record_routed_experts),
    )
    key = next((k for k, on in switches if on), None)
    if key is None:
        return []
    out: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(f"`{key}`=true: {msg} Or set {key}=false.")

    model_path = str(run.model.path)
    experts = num_experts(model_path)
    need(
        experts != 0, f"the model (`{model_path}`) has no experts: routing is for mixture-of-experts models."
    )
    need(
        "vision_config" not in (_model_config(model_path) or {}),
        "a vision-language model's routing is not recorded (its image passes).",
    )
    engine = run.rollout.name
    need(
        engine == "vllm",
        f"`actor_rollout_ref.rollout.name`={engine}: only the vLLM engine records its experts (hf and fake "
        "do not). Use rollout.name=vllm.",
    )
    need(
        not run.async_training.max_staleness and not run.async_training.partial_rollout,
        "asynchronous training and partial rollout (`async_training.max_staleness` > 0, "
        "`async_training.partial_rollout`=true) do not carry recorded experts. Set them to 0 / false.",
    )
    need(
        run.actor.ulysses_sequence_parallel_size in (None, 1),
        "Ulysses sequence parallelism (`actor_rollout_ref.actor.ulysses_sequence_parallel_size` > 1) splits "
        "the tokens the recorded experts are laid out for. Set it to 1.",
    )
    need(
        not run.model.lora_rank,
        "LoRA (`actor_rollout_ref.model.lora_rank` > 0): the reference pass of the adapters-off actor does not "
        "replay. Set lora_rank=0.",
    )
    need(
        run.model.compile_layers is not True,
        "compiled decoder layers (`actor_rollout_ref.model.compile_layers`=true) do not run the routers' "
        "hooks. Set it to false (auto stays off with the key).",
    )
    tp = run.rollout.tensor_model_parallel_size
    need(
        tp in (None, 1),
        f"`actor_rollout_ref.rollout.tensor_model_parallel_size`={tp}: a tensor-parallel engine's experts are not "
        "recorded (its ranks' routers are not read). Set it to 1.",
    )
    return out
