"""The trainer's prompt data: training and validation datasets from ``data.*`` and the training loader."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from fusedrl.config import to_plain_dict
from fusedrl.data.dataset import PromptLoader, RLDataset


def prompt_data(
    config: DictConfig, tokenizer: Any, agent_tools: list[Any] | None
) -> tuple[RLDataset, PromptLoader, RLDataset | None]:
    """``(train dataset, train loader, validation dataset or None)``. ``agent_tools`` (multi-turn runs:
    the tools given in Python, joining the YAML's) puts the tool schemas into the chat template and keeps
    each row's prompt messages for the agent loops (docs/agentic.md), as ``data.return_raw_chat`` does."""
    data = config.data
    # data.return_raw_chat: the row's chat messages ride in extra_info["raw_prompt"] to the reward function.
    extra: dict[str, Any] = {"keep_messages": bool(data.return_raw_chat)}
    if agent_tools is not None:
        from fusedrl.agent import ToolSet, agent_loop_names

        multi_turn = to_plain_dict(config.actor_rollout_ref.rollout.multi_turn)
        schemas = ToolSet.from_config(multi_turn, extra=agent_tools).schemas()
        # Loops registered by algorithm.custom_modules count: the trainer imported them before this.
        extra = {"tools": schemas or None, "keep_messages": True, "agent_names": agent_loop_names()}

    def dataset(files: Any) -> RLDataset:
        return RLDataset(
            files if isinstance(files, str) else list(files),
            tokenizer,
            int(data.max_prompt_length),
            prompt_key=data.prompt_key,
            truncation=data.truncation,
            filter_overlong_prompts=bool(data.filter_overlong_prompts),
            **extra,
        )

    train = dataset(data.train_files)
    # DAPO's dynamic sampling draws data.gen_batch_size prompts a round; plain steps train_batch_size.
    per_round = (
        int(data.gen_batch_size) if config.algorithm.filter_groups.enable else int(data.train_batch_size)
    )
    loader = PromptLoader(train, per_round, shuffle=bool(data.shuffle), seed=int(data.seed))
    return train, loader, dataset(data.val_files) if data.val_files else None
