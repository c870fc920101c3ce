"""Reading a finished (or paused) single-sample request output of vLLM: token ids, their log-probs, why it
stopped.

The engine asks for the sampled token's log-prob only (``logprobs=0``) in vLLM's flat container
(``SamplingParams.flat_logprobs=True``): per generated token the output processor appends one float to a few
plain lists instead of building a ``{token_id: Logprob}`` dict, and a position's log-prob is read straight
from the list here. Same floats either way (the container only changes how they are kept).
"""

from __future__ import annotations

from typing import Any


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token: from the flat container when it holds exactly one entry per
    position for the sampled token, else from each position's ``{token_id: Logprob}``."""
    if logprobs is None:
        return []
    flat_ids, flat_values = getattr(logprobs, "token_ids", None), getattr(logprobs, "logprobs", None)
    one_each = flat_values is not None and len(flat_values) == len(token_ids) == len(logprobs)
    if one_each and flat_ids == token_ids:
        return [float(v) for v in flat_values]
    return [float(step[tok].logprob) for tok, step in zip(token_ids, logprobs) if step]


def completion(out: Any) -> tuple[list[int], list[float], str]:
    """``(token_ids, log_probs, finish_reason)`` of a single-sample request output; ``finish_reason`` is
    ``"length"`` when ``max_tokens`` ended it, else ``"stop"``. ``log_probs`` is empty for a request that asked
    for none (``logprobs=None``: vLLM then holds no container at all; one that asked always gets one)."""
    first = out.outputs[0]
    token_ids = list(first.token_ids)
    reason = "length" if first.finish_reason == "length" else "stop"
    if first.logprobs is None:
        return token_ids, [], reason
    logprobs = sampled_logprobs(token_ids, first.logprobs)
    if len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens; "
            "logprobs=0 should give one per sampled token"
        )
    return token_ids, logprobs, reason
