"""The trainer's prompt data: training and validation datasets from ``data.*`` and the training loader."""

from __future__ import annotations

from typing import Any

from fusedrl.data.dataset import PromptLoader, RLDataset
from fusedrl.role_config import RoleConfigs


def prompt_data(
    run: RoleConfigs, tokenizer: Any, agent_tools: list[Any] | None
) -> tuple[RLDataset, PromptLoader, RLDataset | None]:
    """``(train dataset, train loader, validation dataset or None)``. ``agent_tools`` (multi-turn runs:
    the tools given in Python, joining the YAML's) puts the tool schemas into the chat template and keeps
    each row's prompt messages for the agent loops (docs/agentic.md), as ``data.return_raw_chat`` does."""
    data = run.data
    # data.return_raw_chat: the row's chat messages ride in extra_info["raw_prompt"] to the reward function.
    extra: dict[str, Any] = {"keep_messages": data.return_raw_chat}
    if agent_tools is not None:
        from fusedrl.agent import ToolSet, agent_loop_names

        path = run.rollout.multi_turn.tool_config_path
        schemas = ToolSet.from_config({"tool_config_path": path}, extra=agent_tools).schemas()
        # Loops registered by algorithm.custom_modules count: the trainer imported them before this.
        extra = {"tools": schemas or None, "keep_messages": True, "agent_names": agent_loop_names()}

    def dataset(files: Any) -> RLDataset:
        files = files if isinstance(files, str) else list(files)
        if vision:  # a vision-language model: the prompts' images are read with them (docs/multimodal.md)
            from fusedrl.data.multimodal import VisionLanguageDataset

            return VisionLanguageDataset(  # type: ignore[return-value]
                files,
                processor,
                data.max_prompt_length,
                prompt_key=data.prompt_key,
                image_key=data.image_key,
                filter_overlong_prompts=data.filter_overlong_prompts,
            )
        return RLDataset(
            files,
            tokenizer,
            data.max_prompt_length,
            prompt_key=data.prompt_key,
            truncation=data.truncation,
            filter_overlong_prompts=data.filter_overlong_prompts,
            **extra,
        )

    from fusedrl.models.qwen_vl import is_vision_language_model, load_processor  # transformers' VL classes

    vision = is_vision_language_model(run.model.path)
    if not vision:  # another VLM would read the prompts as text: refused while its images are in the files
        from fusedrl.data.multimodal import check_image_model

        check_image_model(run.model.path, data.train_files, data.image_key)
    processor = load_processor(run.model.path) if vision else None
    if vision and agent_tools is not None:
        raise ValueError("multi-turn rollouts of a vision-language model are not supported yet")
    train = dataset(data.train_files)
    # DAPO's dynamic sampling draws data.gen_batch_size prompts a round; plain steps train_batch_size.
    per_round = data.gen_batch_size if run.algorithm.filter_groups.enable else data.train_batch_size
    loader = PromptLoader(train, per_round, shuffle=data.shuffle, seed=data.seed)
    return train, loader, dataset(data.val_files) if data.val_files else None
