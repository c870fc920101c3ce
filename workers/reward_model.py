"""The reward-model role: a sequence classifier scoring (prompt, response) pairs, fused into the worker.

The score of a sample is the classifier head applied to the hidden state of the *last response token*.
We pick that position ourselves instead of relying on Hugging Face's pooling, which locates the last
token through the first pad token and so breaks on left-padded prompts: the full forward runs (so FSDP2
gathers every shard through the root module's hooks) and a hook on the head keeps its per-token output.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedrl.batch import RolloutBatch
from fusedrl.role_config import RewardModelConfig
from fusedrl.workers.fsdp import shard_for_training, to_dtype
from fusedrl.workers.logprob import micro_batches


def load_reward_model(path: str, dtype: str) -> nn.Module:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=to_dtype(dtype))
    if not hasattr(model, "score") or not hasattr(model, "model"):
        raise ValueError(
            f"reward_model.model.path={path}: expected a decoder sequence classifier with `.model` and `.score` "
            f"(Llama/Qwen style), got {type(model).__name__}"
        )
    model.config.use_cache = False
    return model


class RewardModelRole:
    """Frozen scorer. ``cfg`` is the ``reward_model`` config section."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        model = load_reward_model(cfg.model.path, cfg.fsdp_config.model_dtype)
        self.model = shard_for_training(model, gradient_checkpointing=False, param_dtype=None)  # frozen
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def compute_scores(self, batch: RolloutBatch) -> torch.Tensor:
        """One scalar per sample: ``[B]``."""
        out = []
        for mb in micro_batches(batch, int(self.cfg.micro_batch_size_per_gpu)):
            input_ids, attention_mask, position_ids = mb.sequences()  # [b, T]
            captured: list[torch.Tensor] = []
            handle = self.model.score.register_forward_hook(
                lambda _m, _i, out, sink=captured: sink.append(out)
            )
            try:
                self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            finally:
                handle.remove()
            per_token = captured[0].squeeze(-1)  # [b, T]
            # Last real token: the prompt is left-padded to Tp, the response right-padded.
            real = mb.response_mask if mb.response_attention_mask is None else mb.response_attention_mask
            last = batch.prompts.shape[1] + real.sum(-1).clamp(min=1) - 1  # [b]
            out.append(per_token[torch.arange(per_token.shape[0]), last].float())  # [b]
        return torch.cat(out)
