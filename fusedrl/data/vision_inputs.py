"""A vision-language batch's images per row, as the trainer's forward reads them (`VisionInputs`).

The tensors only: `fusedrl.data.multimodal` decodes and processes the images and `fusedrl.data.dataset.collate`
puts one `VisionInputs` per row into a `RolloutBatch`'s ``multi_modal_inputs``; both import it from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionInputs:
    """Each row's images, decoded and processed (aligned with a `RolloutBatch`'s rows: `collate_vision`)."""

    pixel_values: list[torch.Tensor]  # per row: [patches_i, C*T*P*P] (0 rows for a text-only prompt)
    image_grid_thw: list[torch.Tensor]  # per row: [images_i, 3] long (t, h, w patch counts)
    images: list[list[Any]]  # per row: the decoded images (PIL), what the rollout engine processes itself

    @classmethod
    def from_items(cls, items: Sequence[Mapping]) -> VisionInputs:
        """From `fusedrl.data.multimodal.VisionLanguageDataset` items (or anything with those two keys)."""
        return cls(
            pixel_values=[it["pixel_values"] for it in items],
            image_grid_thw=[it["image_grid_thw"].reshape(-1, 3).long() for it in items],
            images=[list(it.get("images", [])) for it in items],
        )

    def select(self, rows: Sequence[int] | torch.Tensor) -> VisionInputs:
        """The inputs of ``rows`` (a micro-batch, GRPO's repeated samples ``[0, 0, 1, 1, ...]``)."""
        index = [int(r) for r in rows]
        return VisionInputs(
            pixel_values=[self.pixel_values[r] for r in index],
            image_grid_thw=[self.image_grid_thw[r] for r in index],
            images=[self.images[r] for r in index],
        )

    def concatenated(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(pixel_values [patches, D], image_grid_thw [images, 3])`` of all rows in row order, or Nones when
        no row has an image."""
        grids = [g for g in self.image_grid_thw if g.numel()]
        if not grids:
            return None, None
        patches = torch.cat([p for p, g in zip(self.pixel_values, self.image_grid_thw) if g.numel()])
        return patches, torch.cat(grids)
