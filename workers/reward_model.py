"""The reward-model role: a sequence classifier scoring (prompt, response) pairs, fused into the worker.

The score of a sample is the classifier head applied to the hidden state of the *last response token*.
We pick that position ourselves instead of relying on Hugging Face's pooling, which locates the last
token through the first pad token and so breaks on left-padded prompts: the full forward runs (so FSDP2
gathers every shard through the root module's hooks) and a hook on the head keeps its per-token output.

With ``reward_model.ulysses_sequence_parallel_size`` > 1 the ranks of a sequence-parallel group get the
same rows, pack them (`fusedrl.workers.packing`) and each runs its slice of the tokens
(`fusedrl.workers.ulysses`); the head's per-token outputs are gathered over the group and each sample's
score is read at its last real token, as in the padded forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.batch import RolloutBatch
from fusedrl.role_config import RewardModelConfig
from fusedrl.workers.fsdp import shard_for_training, to_dtype
from fusedrl.workers.logprob import micro_batches
from fusedrl.workers.packing import pack_batch
from fusedrl.workers.ulysses import check_heads, gather_tokens, slice_packed, sp_group, ulysses_forward


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
        self.sp = int(cfg.ulysses_sequence_parallel_size)
        self.sp_group = sp_group(self.sp)  # collective: every rank builds the role
        model = load_reward_model(cfg.model.path, cfg.fsdp_config.model_dtype)
        self.model = shard_for_training(model, gradient_checkpointing=False, param_dtype=None)  # frozen
        check_heads(self.model, self.sp, "reward_model.ulysses_sequence_parallel_size")
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
                if self.sp_group is not None:
                    out.append(self._sliced_scores(mb, attention_mask, captured))  # [b]
                    continue
                self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            finally:
                handle.remove()
            per_token = captured[0].squeeze(-1)  # [b, T]
            # Last real token: the prompt is left-padded to Tp, the response right-padded.
            real = mb.response_mask if mb.response_attention_mask is None else mb.response_attention_mask
            last = batch.prompts.shape[1] + real.sum(-1).clamp(min=1) - 1  # [b]
            out.append(per_token[torch.arange(per_token.shape[0]), last].float())  # [b]
        return torch.cat(out)

    def _sliced_scores(
        self, mb: RolloutBatch, attention_mask: torch.Tensor, captured: list[torch.Tensor]
    ) -> torch.Tensor:
        """Ulysses: this rank's slice of the packed micro-batch through the model (the head's per-token
        output lands in ``captured``), gathered over the group; the score of each row is the output at its
        last real token (``[b]``). A row with an empty response is scored at its last prompt token."""
        packed = pack_batch(mb)
        piece = slice_packed(packed.input_ids, packed.position_ids, self.sp, dist.get_rank(self.sp_group))
        ulysses_forward(self.model, piece, self.sp_group)
        full = gather_tokens(captured[0][0, :, 0], self.sp_group, dim=0)  # [N'] (N' = N padded to sp)
        last = attention_mask.sum(-1).cumsum(0) - 1  # [b] packed index of each row's last real token
        return full[last].float()  # [b]
