"""Sampling controls of one engine request, engine-neutral: the rollout engines' adapters convert them, the
agent runner builds one per turn (`fusedrl.workers.rollout.base` re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleParams:
    """Sampling controls of one engine request (engine-neutral; each adapter converts them)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # None: the engine's own generator (its seed, then what it sampled before)
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    # False: the request is never paused, so the engine builds only its final output (vLLM: FINAL_ONLY, what its
    # batch generate does; a cumulative output of every request at every step costs ~10% on the tiny model);
    # `pause` refuses it. The agent runner's requests (single-turn generation included) are not pausable.
    pausable: bool = True
    # False: the engine does not compute the sampled tokens' log-probs (an empty list comes back); a training
    # step asks for them only where something reads them (`fusedrl.trainer.step_plan.rollout_log_probs_wanted`).
    log_probs: bool = True
