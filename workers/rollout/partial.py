"""Partial rollout: a step's batch is the first prompt groups to finish; the rest wait for the next step.

A step waits for its longest response; with long-tailed lengths the engine spends the end of a rollout on
a few stragglers. `PartialRollout` takes the step's new prompt groups (``n`` consecutive rows each, as the
driver sends them) together with the groups it carried over from earlier steps, queues every unfinished
sample on its engine (any engine with a request queue and ``pause``), and steps the engine until ``quota``
groups have finished (the caller keeps more groups in flight than it trains on: its first call sends extra
groups, later calls as many as they take). The requests still running are paused: the tokens each sampled so far,
their log-probs and the policy version that sampled each token are kept with the group, and the next
call resumes them as new requests on prompt + those tokens, under the weights of that step.

Rules:
- A group returns only whole (every sample finished), in the order groups finished; carried groups that
  finished in an earlier call come first.
- A sample paused ``max_resumes`` times must finish in the call that resumes it: the call does not stop
  before every such group has finished (so no group waits for ever, and its age in versions is bounded by
  ``max_resumes + 1``).
- A resumed request samples with a seed of its own, derived from the row's seed and the resume count, so a
  run stays reproducible.

The returned rows carry ``token_versions`` [B, Tr] (the version that sampled each response token; 0 on
padding) and ``policy_version`` [B] (the oldest version in the row).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from fusedrl.batch import RolloutBatch, concat
from fusedrl.workers.rollout.base import (
    EngineRollout,
    SamplingConfig,
    attach_responses,
    sample_params,
    unpadded_prompts,
)

_SEED_STRIDE = 0x9E3779B1  # a resumed request's seed: the row's seed + resumes x this (mod 2**63)


def check_partial_call(rows: int, n: int, carried: int, quota: int) -> None:
    """A `generate_partial` call's rows must be whole groups of ``n``, and its ``quota`` at least 1 and at
    most the groups in flight (``carried`` + the new ones)."""
    if rows % n:
        raise ValueError(f"generate_partial: {rows} rows are not groups of n={n}")
    if quota < 1 or quota > carried + rows // n:
        raise ValueError(
            f"generate_partial: quota={quota} groups, but {carried} carried + {rows // n} new are in flight"
        )


@dataclass
class _Sample:
    row: RolloutBatch  # [1] the row as the driver sent it (prompt, fields, seed)
    prompt: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    resumes: int = 0
    done: bool = False


class PartialRollout(EngineRollout):
    """An `EngineRollout` whose `generate_partial` returns the first groups to finish (module docstring).
    ``generate`` (validation, greedy passes) runs the whole batch as `EngineRollout` does."""

    def __init__(
        self,
        engine: object,
        *,
        n: int,
        max_resumes: int,
        max_response_length: int,
        eos_token_id: int,
        pad_token_id: int,
    ) -> None:
        super().__init__(
            engine,
            max_response_length=max_response_length,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        if n < 1 or max_resumes < 0:
            raise ValueError(f"PartialRollout: n={n} must be >= 1 and max_resumes={max_resumes} >= 0")
        self.n = int(n)
        self.max_resumes = int(max_resumes)
        self.carried: list[list[_Sample]] = []  # groups waiting for the next call, oldest first

    @property
    def carried_samples(self) -> int:
        return sum(len(g) for g in self.carried)

    def generate_partial(
        self, batch: RolloutBatch, sampling: SamplingConfig, *, version: int, quota: int, drain: bool = False
    ) -> RolloutBatch:
        """``quota`` whole groups, the first to finish among the carried ones and the new ones of ``batch``,
        sampled by policy ``version`` from here on. Groups in flight are the carried plus the new: a caller
        that sends ``quota`` new groups a call keeps as many in flight as its first call sent. ``drain``:
        every request runs to its end (the groups beyond the quota are carried finished)."""
        check_partial_call(batch.num_samples, self.n, len(self.carried), quota)
        seeds = batch.sample_seeds.tolist() if batch.sample_seeds is not None else [0] * batch.num_samples
        prompts = unpadded_prompts(batch)
        new = [
            [
                _Sample(batch[i : i + 1], prompts[i], int(seeds[i]))
                for i in range(g * self.n, (g + 1) * self.n)
            ]
            for g in range(batch.num_samples // self.n)
        ]
        groups = self.carried + new
        budget = min(sampling.max_tokens, self.max_response_length)
        params = sample_params(sampling, stop_token_id=self.eos_token_id)
        finished = [g for g in groups if all(s.done for s in g)]
        running: dict[str, tuple[list[_Sample], _Sample]] = {}
        for gi, group in enumerate(groups):
            for si, s in enumerate(group):
                if s.done:
                    continue
                rid = f"{gi}.{si}"
                running[rid] = (group, s)
                seed = (s.seed + s.resumes * _SEED_STRIDE) % (1 << 63)
                left = budget - len(s.ids)
                self.engine.submit(rid, s.prompt + s.ids, replace(params, seed=seed, max_tokens=left))
        overdue = [g for g in groups if any(s.resumes >= self.max_resumes and not s.done for s in g)]
        if drain:
            overdue = groups
        while running and (len(finished) < quota or not all(all(s.done for s in g) for g in overdue)):
            for rid, ids, lps, _ in self.engine.step():
                group, s = running.pop(rid)
                self._extend(s, ids, lps, version)
                s.done = True
                if all(x.done for x in group):
                    finished.append(group)
        for rid, ids, lps in self.engine.pause() if running else []:
            _, s = running.pop(rid)
            if ids:  # a request paused before its first token has not started: nothing to resume
                self._extend(s, ids, lps, version)
                s.resumes += 1
            if len(s.ids) >= budget:  # paused on its last token: it is complete
                s.done = True
        taken = finished[:quota]
        self.carried = [g for g in groups if not any(g is t for t in taken)]
        return self._rows(taken)

    def state(self) -> dict:
        """The carried groups as plain values (tensors, lists, ints), for a checkpoint: a run resumed from
        it continues the paused requests as the uninterrupted run does (`load_state`). The engine holds
        nothing between calls: every carried request was paused, and resumes from these tokens."""
        return {
            "groups": [
                [
                    {
                        "row": s.row.to_dict(),
                        "prompt": s.prompt,
                        "seed": s.seed,
                        "ids": s.ids,
                        "log_probs": s.log_probs,
                        "versions": s.versions,
                        "resumes": s.resumes,
                        "done": s.done,
                    }
                    for s in group
                ]
                for group in self.carried
            ]
        }

    def load_state(self, state: dict) -> None:
        """Carry the groups of `state` (what a checkpoint saved), replacing any carried now."""
        self.carried = [
            [
                _Sample(
                    RolloutBatch.from_dict(d["row"], batch_size=[1]),
                    list(d["prompt"]),
                    int(d["seed"]),
                    list(d["ids"]),
                    list(d["log_probs"]),
                    list(d["versions"]),
                    int(d["resumes"]),
                    bool(d["done"]),
                )
                for d in group
            ]
            for group in state["groups"]
        ]

    @staticmethod
    def _extend(s: _Sample, ids: list[int], lps: list[float], version: int) -> None:
        s.ids += list(ids)
        s.log_probs += list(lps)
        s.versions += [version] * len(ids)

    def _rows(self, groups: list[list[_Sample]]) -> RolloutBatch:
        samples = [s for g in groups for s in g]
        out = concat([s.row for s in samples])  # prompts: every batch is padded to data.max_prompt_length
        attach_responses(
            out,
            [(s.ids, s.log_probs) for s in samples],
            max_response_length=self.max_response_length,
            pad_token_id=self.pad_token_id,
        )
        versions = torch.zeros_like(out.responses)  # [B, Tr]
        for i, s in enumerate(samples):
            n = min(len(s.versions), self.max_response_length)
            versions[i, :n] = torch.as_tensor(s.versions[:n], dtype=torch.long)
        out.token_versions = versions
        out.policy_version = torch.tensor([min(s.versions, default=0) for s in samples], dtype=torch.long)
        return out
