"""The GGUF importer (fusedrl.models.import_gguf): the real SmolLM2 file round-trips to an HF folder with the
GGUF model's log-probs, and every bad input gets a clear error before any work is lost."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from fusedrl.models import import_gguf as ig

pytestmark = pytest.mark.filterwarnings("ignore")


def _tiny_gguf(path: Path, arch: str) -> Path:
    """A valid GGUF file with one tensor and ``general.architecture = arch``."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_not_a_gguf_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00not gguf")
    with pytest.raises(ig.GGUFImportError, match="not a GGUF file"):
        ig.import_gguf(bad, tmp_path / "out")
    with pytest.raises(ig.GGUFImportError, match="no such file"):
        ig.import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_architecture_transformers_cannot_dequantize_is_refused(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "odd.gguf", "notamodel")
    with pytest.raises(ig.GGUFImportError, match=r"architecture `notamodel`.*llama"):
        ig.import_gguf(path, tmp_path / "out")
    # a supported architecture passes the header check (and counts the weights)
    assert ig.read_gguf_header(_tiny_gguf(tmp_path / "ok.gguf", "llama")) == ("llama", 32)


def test_a_full_disk_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tiny_gguf(tmp_path / "m.gguf", "llama")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10, 10, 1 << 20))  # 1 MiB

    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded although the disk cannot take it")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ig.GGUFImportError, match=r"MiB free.*--dtype bfloat16"):
        ig.import_gguf(path, tmp_path / "out")


def test_the_disk_filling_while_writing_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC in the middle of ``save_pretrained``: a clear error, no folder at --out, no temporary left."""
    import transformers

    from fusedrl.utils.tiny_model import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny", preset="tiny")
    path = _tiny_gguf(tmp_path / "m.gguf", "llama")
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *_a, **_k: tok)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *_a, **_k: model)

    def full(self, *_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "out"
    with pytest.raises(ig.GGUFImportError, match="disk filled"):
        ig.import_gguf(path, out)
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.")]


def test_the_real_model_folder_reproduces_the_gguf_log_probs(smollm2_dir: str) -> None:
    """The cached SmolLM2 folder (imported by the fixture) loads as a plain Llama in float32 and gives the
    GGUF model's next-token log-probs on a chat prompt the check did not use."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = json.loads((Path(smollm2_dir) / "fusedrl_import.json").read_text())
    assert report["model_class"] == "LlamaForCausalLM" and report["parameters"] == 134_515_008
    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    src = Path(report["source"])
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    folder_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Add 48 and 19."}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        a = torch.log_softmax(gguf_model(input_ids=ids).logits.float(), -1)  # [1, T, V]
        b = torch.log_softmax(folder_model(input_ids=ids).logits.float(), -1)
    assert (a - b).abs().max() <= 1e-4
    # tied embeddings survive the rebuild: one storage
    assert folder_model.lm_head.weight.data_ptr() == folder_model.model.embed_tokens.weight.data_ptr()
