"""Prompt dataset, collation into `RolloutBatch`, and a resumable prompt loader.

Input files use verl's parquet schema: one row per prompt with at least the columns

    data_source   str                     picks the reward function
    prompt        list[{role, content}]   chat messages (the column name is ``prompt_key``)
    reward_model  {ground_truth, ...}     reference answer for the rule reward

and optionally ``extra_info`` (a dict passed through to the reward function). Every row is checked and
tokenized when the dataset is built, so a bad file fails at start-up with the file, the row and the fix,
instead of hours later inside a worker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusedrl.batch import RolloutBatch
from fusedrl.data.vision_inputs import VisionInputs

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
_MAX_REPORTED_PROBLEMS = 5


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message names the file, the row and the fix."""


def _as_file_list(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out = [os.fspath(f) for f in files]  # also accepts OmegaConf ListConfig
    if not out:
        raise DataError("no dataset files given; set data.train_files / data.val_files to parquet paths")
    return out


def _file_tags(paths: list[str]) -> list[str]:
    """Per-file prefix for uids: the file stem, made unique when two files share a stem."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{k}.{stem}" for k, stem in enumerate(stems)]


def _read_parquet(path: str):
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise DataError(f"{path}: file not found; check data.train_files / data.val_files")
    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... depending on the damage
        raise DataError(
            f"{path}: cannot be read as a parquet file ({type(exc).__name__}: {exc}); regenerate it, e.g. "
            f"with examples/data_preprocess/*.py"
        ) from exc


def _check_messages(prompt: Any) -> str | None:
    """None if ``prompt`` is a non-empty list of {role, content} messages, else what is wrong and how to fix it."""
    if isinstance(prompt, str):
        return (
            "the prompt is a plain string; store it as a chat message list, "
            '[{"role": "user", "content": ...}]'
        )
    if not isinstance(prompt, (list, tuple)):
        return (
            f"the prompt is a {type(prompt).__name__}, expected a list of "
            '{"role": ..., "content": ...} messages'
        )
    if len(prompt) == 0:
        return 'the prompt is an empty list; give at least one {"role": "user", "content": ...} message'
    for k, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"prompt message {k} is a {type(message).__name__}, expected a {{role, content}} dict"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"prompt message {k} has no role (got {role!r}); set it to e.g. 'user' or 'system'"
        if not isinstance(content, str):
            return f"prompt message {k} has content {content!r}, expected a non-empty string"
        if not content.strip():
            return f"prompt message {k} (role {role!r}) has empty content; remove the row or fill the message"
    return None


def _clean_messages(prompt: Sequence[Mapping]) -> list[dict]:
    # Parquet structs give every message every key seen in the column (None where absent); drop those.
    return [{key: value for key, value in m.items() if value is not None} for m in prompt]


class RLDataset:
    """Tokenized chat prompts from one or more verl-schema parquet files.

    Args:
        files: a parquet path or a list of them; rows are concatenated in file order.
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_prompt_length: longest prompt, in tokens after the chat template (``data.max_prompt_length``).
        prompt_key: name of the message-list column (``data.prompt_key``).
        filter_overlong_prompts: drop prompts longer than ``max_prompt_length`` (counted in ``num_filtered``
            and logged) before ``truncation`` is looked at (``data.filter_overlong_prompts``).
        truncation: what to do with an over-long prompt that was not dropped (``data.truncation``):
            ``"error"`` raises `DataError` naming the row, ``"left"`` keeps its last ``max_prompt_length``
            tokens, ``"right"`` its first ones, ``"middle"`` its first ``max_prompt_length // 2`` and its
            last ``max_prompt_length - max_prompt_length // 2`` tokens.
        tools: tool schemas passed to the chat template as ``tools=`` (multi-turn tool rollouts).
        keep_messages: keep each row's prompt messages in ``extra_info["raw_prompt"]`` (multi-turn rollouts,
            ``data.return_raw_chat``).
        agent_names: the agent loops a row may name (multi-turn rollouts); a row naming another is a
            `DataError` naming the row and these names.

    An optional ``agent_name`` column picks each row's agent loop (kept as ``extra_info["agent_name"]``).

    Each item (``dataset[i]``) is a dict with ``prompt_ids`` (list[int], chat template applied, no further
    special tokens), ``data_source``, ``ground_truth`` (str), ``extra_info`` (dict) and ``uid``: the file
    stem and the row's index in its file (``"train-17"``), stable across runs and filtering, and shared by
    all samples generated from that prompt.
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        tools: Sequence[dict] | None = None,
        keep_messages: bool = False,
        agent_names: Sequence[str] | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be a positive integer, got {max_prompt_length!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "the tokenizer has no chat template, so prompts cannot be rendered; use an instruct/chat "
                "tokenizer or set tokenizer.chat_template"
            )
        self.files = _as_file_list(files)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.tools = list(tools) if tools else None
        self.keep_messages = keep_messages
        self.agent_names = sorted(agent_names) if agent_names is not None else None
        self.num_filtered = 0
        self.num_truncated = 0

        self._prompt_ids: list[list[int]] = []
        self._data_source: list[str] = []
        self._ground_truth: list[str] = []
        self._extra_info: list[dict] = []
        self._uid: list[str] = []
        for path, tag in zip(self.files, _file_tags(self.files)):
            self._load_file(path, tag)

        if self.num_filtered:
            logger.warning(
                "RLDataset: dropped %d of %d prompts longer than max_prompt_length=%d tokens (%s)",
                self.num_filtered,
                self.num_filtered + len(self._uid),
                max_prompt_length,
                ", ".join(self.files),
            )
        if self.num_truncated:
            logger.warning(
                "RLDataset: %s-truncated %d prompts to max_prompt_length=%d tokens",
                truncation,
                self.num_truncated,
                max_prompt_length,
            )
        if not self._uid:
            raise DataError(
                f"{', '.join(self.files)}: no usable prompts ({self.num_filtered} dropped as longer than "
                f"max_prompt_length={max_prompt_length}); raise data.max_prompt_length or use shorter prompts"
            )

    # ------------------------------------------------------------------ loading
    def _load_file(self, path: str, tag: str) -> None:
        table = _read_parquet(path)
        required = ("data_source", self.prompt_key, "reward_model")
        missing = [c for c in required if c not in table.column_names]
        if missing:
            hint = (
                f"; set data.prompt_key to the message-list column (now {self.prompt_key!r})"
                if self.prompt_key in missing
                else ""
            )
            raise DataError(
                f"{path}: missing required column(s) {missing}; the file has columns {table.column_names}. "
                f"Each row needs data_source, {self.prompt_key} (chat messages) and reward_model.ground_truth "
                f"(verl schema){hint}"
            )
        if table.num_rows == 0:
            raise DataError(f"{path}: the file has no rows; regenerate it or remove it from the file list")

        columns = {name: table.column(name).to_pylist() for name in required}
        extra = table.column("extra_info").to_pylist() if "extra_info" in table.column_names else None
        agent = table.column("agent_name").to_pylist() if "agent_name" in table.column_names else None

        problems: list[str] = []
        texts: list[str] = []
        kept: list[int] = []
        for row in range(table.num_rows):
            problem = self._check_row(columns, extra, row) or self._check_agent_name(agent, extra, row)
            if problem is not None:
                problems.append(f"row {row}: {problem}")
                continue
            messages = _clean_messages(columns[self.prompt_key][row])
            template_kwargs = {"tools": self.tools} if self.tools else {}
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False, **template_kwargs
                )
            except Exception as exc:
                problems.append(
                    f"row {row}: the chat template failed on this prompt ({type(exc).__name__}: {exc})"
                )
                continue
            texts.append(text)
            kept.append(row)
        if problems:
            shown = "\n  ".join(problems[:_MAX_REPORTED_PROBLEMS])
            more = len(problems) - _MAX_REPORTED_PROBLEMS
            tail = f"\n  ... and {more} more bad rows" if more > 0 else ""
            raise DataError(f"{path}: {len(problems)} bad row(s) (0-based row index):\n  {shown}{tail}")

        # The rendered text already holds every special token the template wants (e.g. <|im_start|>);
        # encoding it with add_special_tokens=True would prepend a BOS a second time for some tokenizers.
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        limit = self.max_prompt_length
        for row, ids in zip(kept, encoded):
            ids = list(ids)
            if len(ids) > limit:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if self.truncation == "error":
                    raise DataError(
                        f"{path}: row {row}: the prompt is {len(ids)} tokens after the chat template, longer "
                        f"than data.max_prompt_length={limit}; raise data.max_prompt_length, shorten the "
                        f"prompt, set data.filter_overlong_prompts=true to drop such rows, or "
                        f"data.truncation=left|right|middle to cut them"
                    )
                ids = truncate_ids(ids, limit, self.truncation)
                self.num_truncated += 1
            reward_model = columns["reward_model"][row]
            info = extra[row] if extra is not None else None
            self._prompt_ids.append(ids)
            self._data_source.append(columns["data_source"][row])
            self._ground_truth.append(str(reward_model["ground_truth"]))
            info = dict(info) if isinstance(info, Mapping) else {}
            # Multi-turn rollouts: the row's agent loop (verl's agent_name column) and, for the strict
            # tokenization check and environments, the prompt messages; both ride in extra_info.
            if agent is not None and agent[row]:
                info["agent_name"] = str(agent[row])
            if self.keep_messages:
                info["raw_prompt"] = _clean_messages(columns[self.prompt_key][row])
            self._extra_info.append(info)
            self._uid.append(f"{tag}-{row}")

    def _check_agent_name(self, agent: list | None, extra: list | None, row: int) -> str | None:
        """With ``agent_names`` (multi-turn runs): the row's agent_name (column or extra_info) must be one."""
        if self.agent_names is None:
            return None
        info = extra[row] if extra is not None and isinstance(extra[row], Mapping) else {}
        name = (agent[row] if agent is not None else None) or info.get("agent_name")
        if not name or str(name) in self.agent_names:
            return None
        return (
            f"agent_name {name!r} is not an agent loop; allowed: {', '.join(self.agent_names)} (register "
            "another with fusedrl.agent.register_agent_loop / register_environment in a module listed in "
            "algorithm.custom_modules)"
        )

    def _check_row(self, columns: dict[str, list], extra: list | None, row: int) -> str | None:
        data_source = columns["data_source"][row]
        if not isinstance(data_source, str) or not data_source:
            return f"data_source is {data_source!r}, expected a non-empty string naming the task"
        problem = _check_messages(columns[self.prompt_key][row])
        if problem is not None:
            return f"column {self.prompt_key!r}: {problem}"
        reward_model = columns["reward_model"][row]
        if not isinstance(reward_model, Mapping):
            return f'reward_model is {reward_model!r}, expected a dict like {{"ground_truth": ...}}'
        if reward_model.get("ground_truth") is None:
            return (
                'reward_model.ground_truth is missing; store the reference answer as {"ground_truth": "..."}'
            )
        if extra is not None and extra[row] is not None and not isinstance(extra[row], Mapping):
            return f"extra_info is a {type(extra[row]).__name__}, expected a dict or null"
        return None

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._uid)

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"RLDataset index {i} out of range for {len(self)} prompts")
        return {
            "prompt_ids": list(self._prompt_ids[i]),
            "data_source": self._data_source[i],
            "ground_truth": self._ground_truth[i],
            "extra_info": dict(self._extra_info[i]),
            "uid": self._uid[i],
        }

    @property
    def pad_token_id(self) -> int:
        return tokenizer_pad_id(self.tokenizer)


def truncate_ids(ids: list[int], limit: int, side: str) -> list[int]:
    """Cut ``ids`` to ``limit`` tokens: ``left`` drops the start, ``right`` the end, ``middle`` the centre
    (the first ``limit // 2`` and the last ``limit - limit // 2`` tokens are kept)."""
    if len(ids) <= limit:
        return list(ids)
    if side == "left":
        return list(ids[len(ids) - limit :])
    if side == "right":
        return list(ids[:limit])
    if side == "middle":
        head = limit // 2
        return list(ids[:head]) + list(ids[len(ids) - (limit - head) :])
    raise ValueError(f"truncation side must be left, right or middle, got {side!r}")


def tokenizer_pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, or its EOS id when it has no pad token."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise DataError("the tokenizer has neither a pad token nor an EOS token to pad with")
    return int(pad)


def collate(rows: Sequence[Mapping], pad_token_id: int, max_prompt_length: int) -> RolloutBatch:
    """Stack dataset items into a prompt-only `RolloutBatch`, left-padded to exactly ``max_prompt_length``."""
    if not rows:
        raise ValueError("collate() of no rows")
    b = len(rows)
    prompts = torch.full((b, max_prompt_length), int(pad_token_id), dtype=torch.long)  # [B, Tp]
    prompt_mask = torch.zeros((b, max_prompt_length), dtype=torch.long)  # [B, Tp]
    for r, row in enumerate(rows):
        ids = row["prompt_ids"]
        n = len(ids)
        if n == 0:
            raise ValueError(f"collate: row {r} (uid {row.get('uid')!r}) has an empty prompt")
        if n > max_prompt_length:
            raise ValueError(
                f"collate: row {r} (uid {row.get('uid')!r}) has {n} prompt tokens, more than "
                f"max_prompt_length={max_prompt_length}"
            )
        prompts[r, max_prompt_length - n :] = torch.as_tensor(ids, dtype=torch.long)
        prompt_mask[r, max_prompt_length - n :] = 1
    batch = RolloutBatch.from_prompts(
        prompts,
        prompt_mask,
        uid=[row["uid"] for row in rows],
        data_source=[row["data_source"] for row in rows],
        ground_truth=[row["ground_truth"] for row in rows],
        extra_info=[dict(row.get("extra_info") or {}) for row in rows],
    )
    if "image_grid_thw" in rows[0]:  # vision-language items (`fusedrl.data.multimodal`): images ride per row
        batch.multi_modal_inputs = [VisionInputs.from_items([row]) for row in rows]
    return batch


def _epoch_seed(seed: int, epoch: int) -> int:
    # Mix the two so (seed, epoch) pairs do not collide the way seed + epoch would.
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + 0x5EED) % (2**63 - 1)


class PromptLoader:
    """Yields `RolloutBatch` prompt batches, one epoch per ``iter()``, and resumes mid-epoch.

    The sample order of epoch ``e`` is ``torch.randperm`` under a generator seeded from ``(seed, e)`` (or the
    dataset order when ``shuffle=False``), so it does not depend on anything that happened before. The
    position is ``(epoch, index_in_epoch)``: ``index_in_epoch`` counts batches of the current epoch already
    handed out. A batch counts as consumed as soon as it is yielded, so a checkpoint saved after training on
    it resumes with the next one. When an epoch's batches are exhausted the loader moves to the next epoch.
    """

    def __init__(
        self,
        dataset: RLDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_token_id: int | None = None,
        max_prompt_length: int | None = None,
        batch_size_key: str = "data.train_batch_size",
    ) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"{batch_size_key} must be a positive integer, got {batch_size!r}")
        if batch_size > len(dataset):
            raise DataError(
                f"{batch_size_key}={batch_size} is larger than the dataset ({len(dataset)} prompts after "
                f"filtering); lower {batch_size_key} or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else dataset.pad_token_id
        self.max_prompt_length = int(max_prompt_length or dataset.max_prompt_length)
        self.epoch = 0
        self.index_in_epoch = 0

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(n, generator=generator).tolist()

    def __iter__(self):
        num_batches = len(self)
        order = self.epoch_order(self.epoch)
        while self.index_in_epoch < num_batches:
            start = self.index_in_epoch * self.batch_size
            indices = order[start : start + self.batch_size]
            self.index_in_epoch += 1
            yield collate([self.dataset[i] for i in indices], self.pad_token_id, self.max_prompt_length)
        self.epoch += 1
        self.index_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index_in_epoch": self.index_in_epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        missing = [k for k in ("epoch", "index_in_epoch") if k not in state]
        if missing:
            raise ValueError(f"PromptLoader.load_state_dict: state lacks {missing}; got keys {sorted(state)}")
        epoch, index = int(state["epoch"]), int(state["index_in_epoch"])
        if epoch < 0 or not 0 <= index <= len(self):
            raise ValueError(
                f"PromptLoader.load_state_dict: position (epoch {epoch}, batch {index}) is invalid for "
                f"{len(self)} batches per epoch; was the checkpoint made with another dataset or batch size?"
            )
        self.epoch, self.index_in_epoch = epoch, index
