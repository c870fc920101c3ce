"""DAPO's dynamic sampling: keep only prompt groups whose samples scored differently, until a step has
enough of them.

Paper: "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476), section
3.2. A group whose samples all got the same score has zero group-relative advantage everywhere, so it
adds no gradient and only dilutes the batch; generating more prompts until ``data.train_batch_size``
informative groups are collected keeps the effective batch size constant.

`GroupCollector` is driven by `PPOTrainer.collect_batch`: one generation round at a time, it filters
and accumulates, and says when the step has enough (or raises once ``max_num_gen_batches`` rounds did
not find enough).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedrl.batch import RolloutBatch, concat

# algorithm.filter_groups.metric: what `group_metric` compares a group's samples on
FILTER_METRICS = ("score", "seq_reward", "seq_final_reward", "acc")


def group_metric(batch: RolloutBatch, metric: str, sample_extras: list[dict] | None) -> torch.Tensor:
    """The per-sample value groups are compared on (``algorithm.filter_groups.metric``): ``[B]``.

    ``score`` / ``seq_reward``: the task score; ``seq_final_reward``: the reward after the in-reward KL (the
    score here, as the KL is applied later); ``acc``: the scorer's ``acc`` entry per sample
    (``sample_extras``, from a dict-returning compute_score), else the score.
    """
    scores = batch.token_level_scores.sum(-1)  # [B]
    if metric != "acc" or not sample_extras or len(sample_extras) != batch.num_samples:
        return scores
    return torch.tensor(
        [e.get("acc", float(s)) for e, s in zip(sample_extras, scores.tolist())], dtype=torch.float32
    )  # [B]


def informative_groups(batch: RolloutBatch, metric: torch.Tensor | None = None) -> RolloutBatch:
    """The rows of groups (rows sharing a ``uid``) whose ``metric`` values (default: the sequence scores)
    are not all equal."""
    scores = batch.token_level_scores.sum(-1) if metric is None else metric  # [B]
    by_uid: dict[str, list[int]] = {}
    for i, u in enumerate(batch.field_list("uid")):
        by_uid.setdefault(u, []).append(i)
    keep = [i for rows in by_uid.values() if float(scores[rows].std()) > 0 for i in rows]
    return batch[torch.tensor(keep, dtype=torch.long)]


class GroupCollector:
    """Accumulates filtered generation rounds until ``want`` groups of ``n`` samples are collected."""

    def __init__(
        self,
        *,
        want: int,
        n: int,
        max_rounds: int,
        keep: Callable[[RolloutBatch], RolloutBatch] = informative_groups,
    ) -> None:
        self.want, self.n, self.max_rounds, self.keep = want, n, max_rounds, keep
        self.kept: list[RolloutBatch] = []
        self.num_groups = 0
        self.rounds = 0

    def add(self, batch: RolloutBatch) -> RolloutBatch | None:
        """Take one scored round; the step's batch once ``want`` groups are in, else None (generate more)."""
        self.rounds += 1
        batch = self.keep(batch)
        self.kept.append(batch)
        self.num_groups += batch.num_samples // self.n
        if self.num_groups >= self.want:
            return concat(self.kept)[: self.want * self.n]
        if self.max_rounds > 0 and self.rounds >= self.max_rounds:
            raise RuntimeError(
                f"dynamic sampling found only {self.num_groups} of {self.want} groups with differing rewards "
                f"after {self.max_rounds} generation rounds (algorithm.filter_groups.max_num_gen_batches). The "
                "task is too easy or too hard for the policy: raise max_num_gen_batches, change the data, or "
                "disable algorithm.filter_groups.enable."
            )
        return None
