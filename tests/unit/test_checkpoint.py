"""Checkpointing: the driver-side protocol, a real 2-rank FSDP2 save/resume on gloo, and HF export."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support import free_port, local_params

from fusedrl.checkpoint import (
    COMPLETE_FILE,
    TRACKER_FILE,
    CheckpointError,
    actor_shard_prefix,
    begin_checkpoint,
    capture_rng_state,
    checkpoint_problem,
    checkpoint_step,
    commit_checkpoint,
    disk_error,
    file_sha256,
    find_latest_checkpoint,
    list_complete_checkpoints,
    load_trainer_state,
    read_tracker,
    resolve_resume,
    restore_rng_state,
    save_trainer_state,
    seed_rng,
)

WORLD = 2
ODD_VOCAB = 515  # embed_tokens / lm_head rows do not split evenly over 2 ranks (258 + 257)


# ---------------------------------------------------------------------- protocol
def _fake_checkpoint(root: Path, step: int, max_to_keep: int | None = None) -> str:
    tmp = begin_checkpoint(root, step)
    assert os.path.basename(tmp).startswith(f"global_step_{step}.tmp-")
    Path(tmp, "actor", "rank_0.safetensors").write_bytes(b"x" * step)
    save_trainer_state(tmp, {"global_step": step, "dataloader": {"epoch": 0, "index_in_epoch": step}})
    return commit_checkpoint(root, step, tmp, max_to_keep=max_to_keep)


def test_commit_renames_and_writes_tracker(tmp_path):
    final = _fake_checkpoint(tmp_path, 3)
    assert final == str(tmp_path / "global_step_3")
    assert sorted(os.listdir(tmp_path)) == ["global_step_3", TRACKER_FILE]
    assert (tmp_path / "global_step_3" / COMPLETE_FILE).is_file()
    assert read_tracker(tmp_path) == 3
    assert checkpoint_step(final) == 3
    assert load_trainer_state(final) == {
        "global_step": 3,
        "dataloader": {"epoch": 0, "index_in_epoch": 3},
    }
    assert find_latest_checkpoint(tmp_path) == final
    # Saving the same step again replaces it atomically.
    assert _fake_checkpoint(tmp_path, 3) == final
    assert sorted(os.listdir(tmp_path)) == ["global_step_3", TRACKER_FILE]


def test_incomplete_and_tmp_dirs_are_ignored(tmp_path):
    good = _fake_checkpoint(tmp_path, 2)
    # A newer save that never finished (tmp dir), a newer dir without COMPLETE, a truncated file.
    begin_checkpoint(tmp_path, 7)
    (tmp_path / "global_step_5" / "actor").mkdir(parents=True)
    (tmp_path / "global_step_5" / "trainer_state.json").write_text("{}")
    assert find_latest_checkpoint(tmp_path) == good
    broken = _fake_checkpoint(tmp_path, 9)
    with open(Path(broken, "actor", "rank_0.safetensors"), "wb") as f:
        f.write(b"short")
    assert find_latest_checkpoint(tmp_path) == good  # size mismatch with the COMPLETE manifest
    # Tracker ahead of / behind the scan does not matter: the scan decides.
    (tmp_path / TRACKER_FILE).write_text("42\n")
    assert find_latest_checkpoint(tmp_path) == good
    assert find_latest_checkpoint(tmp_path / "nowhere") is None


def test_manifest_records_size_and_checksum_and_resume_falls_back_past_damage(tmp_path, caplog):
    good, _, newest = (_fake_checkpoint(tmp_path, step) for step in (1, 2, 3))
    manifest = json.loads(Path(newest, COMPLETE_FILE).read_text())
    shard = Path(newest, "actor", "rank_0.safetensors")
    assert manifest["files"]["actor/rank_0.safetensors"] == {"size": 3, "sha256": file_sha256(shard)}
    assert checkpoint_problem(newest, verify=True) is None
    # Step 3: one flipped byte (same size: only the checksum sees it). Step 2: a truncated file.
    shard.write_bytes(b"xyx")
    Path(tmp_path, "global_step_2", "trainer_state.json").write_text("{}")
    assert checkpoint_problem(newest) is None  # the cheap size check alone cannot tell
    assert "actor/rank_0.safetensors fails its SHA-256" in checkpoint_problem(newest, verify=True)
    # An explicit resume_from_path is an error naming the file ...
    with pytest.raises(CheckpointError, match=r"global_step_3.*actor/rank_0.safetensors fails its SHA-256"):
        resolve_resume(tmp_path, "resume_path", newest)
    # ... auto names each damaged one, moves it aside and takes the newest intact one.
    with caplog.at_level("WARNING"):
        assert resolve_resume(tmp_path, "auto") == good
    log = caplog.text
    assert "global_step_3 is damaged: actor/rank_0.safetensors fails its SHA-256" in log, log
    assert "global_step_2 is damaged: trainer_state.json has 2 bytes" in log, log
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if n.startswith("global_step_")][0] == "global_step_1"
    assert sum(n.startswith(("global_step_2.corrupt-", "global_step_3.corrupt-")) for n in names) == 2, names
    # The moved-aside folders are kept (evidence), never resumed from, never pruned.
    _fake_checkpoint(tmp_path, 4, max_to_keep=1)
    assert sum(".corrupt-" in n for n in os.listdir(tmp_path)) == 2
    assert resolve_resume(tmp_path, "auto") == str(tmp_path / "global_step_4")


def test_manifest_without_checksums_still_resumes(tmp_path):
    """Checkpoints written before checksums (manifest: file -> size) stay resumable."""
    final = _fake_checkpoint(tmp_path, 1)
    manifest = json.loads(Path(final, COMPLETE_FILE).read_text())
    manifest["files"] = {rel: entry["size"] for rel, entry in manifest["files"].items()}
    Path(final, COMPLETE_FILE).write_text(json.dumps(manifest))
    assert resolve_resume(tmp_path, "auto") == final


def test_disk_errors_are_recognised_through_wrappers():
    full = OSError(28, "No space left on device")
    assert disk_error(full) == "[Errno 28] No space left on device"
    # safetensors reports the OS error in its text; a worker's error arrives wrapped (cause chain).
    try:
        try:
            raise RuntimeError("Error while serializing: I/O error: Read-only file system (os error 30)")
        except RuntimeError as inner:
            raise RuntimeError("fused worker rank 1 raised an error") from inner
    except RuntimeError as outer:
        assert disk_error(outer) == "[Errno 30] Read-only file system"
    assert disk_error(PermissionError(13, "Permission denied")) == "[Errno 13] Permission denied"
    assert disk_error(ValueError("bad shape")) is None
    assert disk_error(OSError(5, "Input/output error")) is None


def test_max_to_keep_and_stale_tmp_cleanup(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    stale = begin_checkpoint(tmp_path, 4)  # e.g. a crashed save
    (tmp_path / "global_step_0").mkdir()  # incomplete, not ours to delete
    _fake_checkpoint(tmp_path, 5, max_to_keep=2)
    assert not os.path.exists(stale)
    assert [s for s, _ in list_complete_checkpoints(tmp_path)] == [3, 5]
    assert sorted(os.listdir(tmp_path)) == ["global_step_0", "global_step_3", "global_step_5", TRACKER_FILE]
    _fake_checkpoint(tmp_path, 6, max_to_keep=None)  # keep all
    assert [s for s, _ in list_complete_checkpoints(tmp_path)] == [3, 5, 6]


def test_resolve_resume_modes(tmp_path):
    root = tmp_path / "ckpts"
    assert resolve_resume(root, "auto") is None
    assert resolve_resume(root, "disable") is None
    first = _fake_checkpoint(root, 1)
    last = _fake_checkpoint(root, 4)
    assert resolve_resume(root, "auto") == last
    assert resolve_resume(root, "disable") is None
    assert resolve_resume(root, "resume_path", first) == first
    with pytest.raises(CheckpointError, match=r"trainer\.resume_from_path"):
        resolve_resume(root, "resume_path", None)
    with pytest.raises(CheckpointError, match=r"trainer\.resume_from_path=.*COMPLETE"):
        os.remove(Path(first, COMPLETE_FILE))
        resolve_resume(root, "resume_path", first)
    tmp = begin_checkpoint(root, 8)
    with pytest.raises(CheckpointError, match=r"trainer\.resume_from_path=.*\.tmp-"):
        resolve_resume(root, "resume_path", tmp)
    with pytest.raises(CheckpointError, match=r"trainer\.resume_from_path=.*does not exist"):
        resolve_resume(root, "resume_path", str(root / "global_step_99"))
    with pytest.raises(CheckpointError, match=r"trainer\.resume_mode"):
        resolve_resume(root, "latest")


def _draws() -> list[float]:
    return (
        [random.random() for _ in range(3)]
        + [random.gauss(0, 1)]
        + np.random.rand(3).tolist()
        + [float(np.random.randn())]
        + torch.rand(3).tolist()
    )


def test_rng_capture_restore_reproduces_draws():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in both python and numpy state
    np.random.randn()
    state = json.loads(json.dumps(capture_rng_state()))  # must survive JSON
    expected = _draws()
    _draws()
    restore_rng_state(state)
    assert _draws() == expected


def test_seed_rng_makes_fresh_driver_streams_reproducible():
    seed_rng(7)
    first = capture_rng_state()
    expected = _draws()
    seed_rng(7)
    assert capture_rng_state() == first and _draws() == expected
    seed_rng(8)
    assert _draws() != expected


# ---------------------------------------------------------------------- 2-rank FSDP2 on gloo


def _setup(rank: int, port: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    return init_device_mesh("cpu", (WORLD,))


def _build(model_dir: str, mesh, lr: float, betas: tuple[float, float]):
    from fusedrl.workers.fsdp import apply_fsdp2, load_causal_lm

    model = apply_fsdp2(load_causal_lm(model_dir, "float32"), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.1)
    return model, optimizer


def _step(model, optimizer, rank: int) -> None:
    ids = (torch.arange(16).reshape(2, 8) * (rank + 3) + 7) % ODD_VOCAB  # [2, 8], differs per rank
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _train_and_save(rank: int, model_dir: str, port: int, ckpt_tmp: str, out: str) -> None:
    from safetensors.torch import save_file

    from fusedrl.workers.checkpoint_io import save_fsdp_state
    from fusedrl.workers.export import export_hf
    from fusedrl.workers.fsdp import stream_full_tensors

    mesh = _setup(rank, port)
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    model, optimizer = _build(model_dir, mesh, lr=1e-2, betas=(0.9, 0.95))
    for _ in range(2):
        _step(model, optimizer, rank)
    save_fsdp_state(model, optimizer, actor_shard_prefix(ckpt_tmp, rank), extra={"num_skipped_steps": rank})
    info = {
        "draws": _draws(),
        "local_shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters()},
    }
    full = {n: t.clone() for n, t in stream_full_tensors(model)}
    # The stream a bf16 engine gets: shards cast before the gather
    full_bf16 = {n: t.clone() for n, t in stream_full_tensors(model, dtype=torch.bfloat16)}
    if rank == 0:
        save_file(full, os.path.join(out, "full_step2.safetensors"))
        save_file(full_bf16, os.path.join(out, "full_step2_bf16.safetensors"))
    export_hf(
        model, os.path.join(out, "online_hf"), src_model_dir=model_dir, rank=rank, max_shard_bytes=400_000
    )
    _step(model, optimizer, rank)
    save_file(local_params(model), os.path.join(out, f"continued_rank{rank}.safetensors"))
    Path(out, f"train_rank{rank}.json").write_text(json.dumps(info))
    torch.distributed.destroy_process_group()


def _load_and_continue(rank: int, model_dir: str, port: int, ckpt: str, out: str) -> None:
    from safetensors.torch import save_file

    from fusedrl.workers.checkpoint_io import load_fsdp_state, save_fsdp_state

    mesh = _setup(rank, port)
    torch.manual_seed(999)
    model, optimizer = _build(model_dir, mesh, lr=0.5, betas=(0.5, 0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()  # the load must overwrite every shard
    prefix = actor_shard_prefix(ckpt, rank)

    # Mismatches are refused before anything is touched, naming the file.
    errors = []
    for i, (field, value) in enumerate([("world_size", 3), ("entries", "rename")]):
        bad = os.path.join(out, f"bad{i}_rank_{rank}")
        shutil.copyfile(prefix + ".safetensors", bad + ".safetensors")
        meta = json.loads(Path(prefix + ".json").read_text())
        if value == "rename":
            meta["entries"][0]["name"] = "model.no_such_weight"
        else:
            meta[field] = value
        Path(bad + ".json").write_text(json.dumps(meta))
        try:
            load_fsdp_state(model, optimizer, bad)
            errors.append("no error")
        except CheckpointError as e:
            errors.append(str(e))

    extra = load_fsdp_state(model, optimizer, prefix)
    # Saving right after loading must reproduce the checkpoint bit for bit (shards, optimizer, RNG).
    save_fsdp_state(model, optimizer, os.path.join(out, "resaved", f"rank_{rank}"), extra=extra)
    group = optimizer.param_groups[0]
    info = {
        "extra": extra,
        "errors": errors,
        "lr": group["lr"],
        "betas": list(group["betas"]),
        "betas_is_tuple": isinstance(group["betas"], tuple),
        "draws": _draws(),
    }
    _step(model, optimizer, rank)
    save_file(local_params(model), os.path.join(out, f"resumed_rank{rank}.safetensors"))
    Path(out, f"load_rank{rank}.json").write_text(json.dumps(info))
    torch.distributed.destroy_process_group()


def _spawn(fn, *args) -> None:
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(*args,), nprocs=WORLD, join=True)


@pytest.fixture(scope="module")
def odd_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny Qwen2 with a vocabulary of 515 rows, so dim 0 of embeddings/LM head splits unevenly."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("odd_model")
    for name in os.listdir(tiny_model_dir):
        if not name.startswith("model") and not name.startswith("config"):
            shutil.copyfile(os.path.join(tiny_model_dir, name), out / name)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.vocab_size = ODD_VOCAB
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def fsdp_run(odd_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpts")
    out = tmp_path_factory.mktemp("results")
    tmp = begin_checkpoint(root, 2)
    _spawn(_train_and_save, odd_model_dir, free_port(), tmp, str(out))
    save_trainer_state(tmp, {"global_step": 2, "rng": capture_rng_state()})
    final = commit_checkpoint(root, 2, tmp, max_to_keep=3)
    assert find_latest_checkpoint(root) == final
    _spawn(_load_and_continue, odd_model_dir, free_port(), final, str(out))
    return {"root": str(root), "ckpt": final, "out": str(out), "model_dir": odd_model_dir}


def _read_all(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def test_shards_are_uneven_and_complete(fsdp_run):
    shapes = [
        json.loads(Path(fsdp_run["out"], f"train_rank{r}.json").read_text())["local_shapes"] for r in (0, 1)
    ]
    assert shapes[0]["model.embed_tokens.weight"] == [258, 128]
    assert shapes[1]["model.embed_tokens.weight"] == [257, 128]
    keys = _read_all(actor_shard_prefix(fsdp_run["ckpt"], 1) + ".safetensors").keys()
    assert "optim.lm_head.weight.exp_avg" in keys and "optim.lm_head.weight.exp_avg_sq" in keys
    assert "optim.lm_head.weight.step" in keys and "rng.torch_cpu" in keys
    meta = json.loads(Path(actor_shard_prefix(fsdp_run["ckpt"], 1) + ".json").read_text())
    assert meta["world_size"] == 2 and meta["rank"] == 1
    assert meta["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.95]


def test_load_is_bit_identical_and_resume_matches(fsdp_run):
    out = fsdp_run["out"]
    for rank in range(WORLD):
        saved = _read_all(actor_shard_prefix(fsdp_run["ckpt"], rank) + ".safetensors")
        resaved = _read_all(os.path.join(out, "resaved", f"rank_{rank}.safetensors"))
        _assert_same(saved, resaved)
        assert float(saved["optim.lm_head.weight.step"]) == 2.0
        meta = json.loads(Path(actor_shard_prefix(fsdp_run["ckpt"], rank) + ".json").read_text())
        meta_again = json.loads(Path(out, "resaved", f"rank_{rank}.json").read_text())
        assert meta == meta_again
        info = json.loads(Path(out, f"load_rank{rank}.json").read_text())
        train_info = json.loads(Path(out, f"train_rank{rank}.json").read_text())
        assert info["extra"] == {"num_skipped_steps": rank}
        assert info["lr"] == 1e-2 and info["betas"] == [0.9, 0.95] and info["betas_is_tuple"]
        assert info["draws"] == train_info["draws"]  # python, numpy and torch RNG restored per rank
        assert f"saved by rank {rank} of 3" in info["errors"][0], info["errors"][0]
        assert f"bad0_rank_{rank}.safetensors" in info["errors"][0]
        assert "model.no_such_weight" in info["errors"][1] and f"bad1_rank_{rank}" in info["errors"][1]
        # One more identical step from the continued and from the resumed run: identical parameters.
        _assert_same(
            _read_all(os.path.join(out, f"continued_rank{rank}.safetensors")),
            _read_all(os.path.join(out, f"resumed_rank{rank}.safetensors")),
        )


def _hf_state(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_offline_export_matches_trained_model(fsdp_run, tmp_path):
    from fusedrl.trainer.export import export_checkpoint, main

    full = _read_all(os.path.join(fsdp_run["out"], "full_step2.safetensors"))
    out = tmp_path / "hf"
    files = export_checkpoint(fsdp_run["ckpt"], fsdp_run["model_dir"], str(out))
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    _assert_same(_hf_state(str(out)), full)

    # Bounded shards + index, through the CLI entry point.
    sharded = tmp_path / "hf_sharded"
    argv = ["--ckpt", fsdp_run["ckpt"], "--model_path", fsdp_run["model_dir"], "--out", str(sharded)]
    assert main([*argv, "--max_shard_gb", str(300_000 / (1 << 30))]) == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1 and all(os.path.isfile(sharded / f) for f in shard_files)
    assert sorted(index["weight_map"]) == sorted(full)
    _assert_same(_hf_state(str(sharded)), full)
    # An incomplete checkpoint is refused.
    assert (
        main(["--ckpt", str(tmp_path / "global_step_1"), "--model_path", ".", "--out", str(tmp_path / "x")])
        == 2
    )


def test_online_export_matches_trained_model(fsdp_run):
    full = _read_all(os.path.join(fsdp_run["out"], "full_step2.safetensors"))
    online = os.path.join(fsdp_run["out"], "online_hf")
    assert os.path.isfile(os.path.join(online, "model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(online, "tokenizer.json"))
    _assert_same(_hf_state(online), full)


def test_stream_cast_before_the_gather_equals_casting_the_full_tensor(fsdp_run):
    full = _read_all(os.path.join(fsdp_run["out"], "full_step2.safetensors"))
    cast = _read_all(os.path.join(fsdp_run["out"], "full_step2_bf16.safetensors"))
    assert sorted(cast) == sorted(full)
    for name, tensor in full.items():
        assert cast[name].dtype == torch.bfloat16, name
        assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name  # bit for bit


def test_no_pickle_in_checkpoint(fsdp_run):
    files = [os.path.join(d, f) for d, _, fs in os.walk(fsdp_run["root"]) for f in fs]
    assert files
    for path in files:
        assert not path.endswith((".pkl", ".pt", ".pth", ".bin", ".pickle")), path
        with open(path, "rb") as f:
            head = f.read(2)
        assert head != b"\x80\x04" and head != b"\x80\x02", f"{path} looks like a pickle"
    names = sorted(os.path.relpath(p, fsdp_run["ckpt"]) for p in files if p.startswith(fsdp_run["ckpt"]))
    assert names == [
        COMPLETE_FILE,
        "actor/rank_0.json",
        "actor/rank_0.safetensors",
        "actor/rank_1.json",
        "actor/rank_1.safetensors",
        "trainer_state.json",
    ]


def test_uneven_reassembly_synthetic():
    from fusedrl.trainer.export import assemble_full_tensor

    full = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4)
    pieces = list(torch.chunk(full, 4, dim=0))
    pieces += [full[3:]] * (4 - len(pieces))  # torch.chunk yields 3 chunks: rank 3 holds an empty shard
    assert [p.shape[0] for p in pieces] == [1, 1, 1, 0]
    assert torch.equal(assemble_full_tensor(pieces, {"kind": "shard", "dim": 0}, [3, 4]), full)
    assert torch.equal(assemble_full_tensor([full, full], {"kind": "replicate"}, [3, 4]), full)
    with pytest.raises(CheckpointError, match="recorded full shape"):
        assemble_full_tensor(pieces[:2], {"kind": "shard", "dim": 0}, [3, 4], "w")
