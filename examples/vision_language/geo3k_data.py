"""Download Geometry3K (hiyouga/geometry3k) and write it as verl-schema multimodal parquet files.

    pip install datasets
    python examples/vision_language/geo3k_data.py --local_dir ~/data/geo3k

Writes ``train.parquet`` (2101 problems) and ``test.parquet`` (601 problems). Each problem's text holds one
``<image>`` placeholder where its diagram goes, and its ``images`` column one diagram (PNG bytes), the layout
`fusedrl.data.multimodal.VisionLanguageDataset` reads (``data.image_key=images``)::

    {"data_source": "hiyouga/geometry3k",
     "prompt": [{"role": "user", "content": "<image>Find x. <instruction: think, then \\boxed{}>"}],
     "images": [{"bytes": b"\\x89PNG..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"split": "train", "index": 0, "question": "...", "answer": "3"}}

The reward of the GPU recipe (run_qwen2_5_vl_3b_geo3k.sh) is `geo3k_reward.compute_score`, beside this file.
"""

from __future__ import annotations

import argparse
import io
import os
from collections.abc import Iterable, Mapping
from typing import Any

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = "Reason step by step inside <think> </think> first, then give the final answer in \\boxed{}."


def _png(image: Any) -> dict[str, bytes]:
    """A PIL image (what `datasets` decodes) or an already-encoded ``{"bytes": ...}`` as ``{"bytes": png}``."""
    if isinstance(image, Mapping) and image.get("bytes"):
        return {"bytes": bytes(image["bytes"])}
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return {"bytes": buf.getvalue()}


def make_rows(examples: Iterable[Mapping[str, Any]], split: str) -> list[dict[str, Any]]:
    """Geometry3K records (``problem`` with ``<image>``, ``answer``, ``images``) to verl-schema rows."""
    rows = []
    for index, example in enumerate(examples):
        problem = str(example["problem"]).strip()
        images = [_png(im) for im in example["images"]]
        if problem.count("<image>") != len(images):
            raise ValueError(
                f"{split} row {index}: {problem.count('<image>')} <image> placeholder(s) for {len(images)} "
                f"image(s); the dataset's layout changed"
            )
        answer = str(example["answer"]).strip()
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
                "images": images,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "question": problem, "answer": answer},
            }
        )
    return rows


def main(argv: list[str] | None = None) -> tuple[str, str]:
    parser = argparse.ArgumentParser(description="Geometry3K to verl-schema multimodal parquet.")
    parser.add_argument("--local_dir", default="~/data/geo3k", help="output folder")
    parser.add_argument("--dataset", default=DATA_SOURCE, help="hub dataset id or a local copy of it")
    args = parser.parse_args(argv)

    import datasets  # imported here so the module's helpers work without `datasets`
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = datasets.load_dataset(args.dataset)
    out_dir = os.path.expanduser(args.local_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split in ("train", "test"):
        path = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(make_rows(raw[split], split)), path)
        paths.append(path)
        print(path)
    return paths[0], paths[1]


if __name__ == "__main__":
    main()
