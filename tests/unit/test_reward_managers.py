"""Reward managers: batch (one call), dapo (overlong shaping), worker pool with per-sample timeouts, the
on_error policy, metrics, and build_reward_manager."""

from __future__ import annotations

import os
import time

import pytest
import torch
from omegaconf import OmegaConf

from fusedrl.batch import RolloutBatch
from fusedrl.rewards import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    build_reward_manager,
)
from fusedrl.rewards.custom import FileRewardFunction
from fusedrl.rewards.manager import overlong_penalty

TR = 20
TIMEOUT_S = 1.0
SLACK_S = 4.0  # generous: the test machine may be heavily loaded


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from fusedrl.utils.tiny_model import build_tokenizer

    cache = tmp_path_factory.getbasetemp() / "fusedrl_test_tokenizer"
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    return build_tokenizer(cache)


def _batch(tokenizer, texts, truths, data_sources=None, lengths=None):
    """Right-padded responses from ``texts`` (+ EOS); with ``lengths``, rows of that many tokens instead."""
    pad, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    b = len(texts)
    responses = torch.full((b, TR), pad, dtype=torch.long)
    mask = torch.zeros((b, TR), dtype=torch.long)
    filler = tokenizer.encode("7", add_special_tokens=False)
    for i, text in enumerate(texts):
        if lengths is not None:
            ids = (filler * TR)[: lengths[i]]
        else:
            ids = (tokenizer.encode(text, add_special_tokens=False) if text else []) + [eos_id]
        assert len(ids) <= TR, (text, len(ids))
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
    batch = RolloutBatch.from_prompts(
        torch.ones((b, 3), dtype=torch.long),
        torch.ones((b, 3), dtype=torch.long),
        uid=[f"u{i}" for i in range(b)],
        data_source=data_sources or ["arithmetic"] * b,
        ground_truth=truths,
        extra_info=[{"index": i} for i in range(b)],
    )
    batch.responses = responses
    batch.response_mask = mask
    return batch


def _placed(scores, batch):
    """The score on each row's last valid token (0 for empty rows)."""
    lengths = batch.response_mask.sum(1)
    return [scores[i, n - 1].item() if n else 0.0 for i, n in enumerate(lengths.tolist())]


# Scorers for the worker processes. Module-level, so "fork" and the picklable path both work.
def _echo_scorer(data_source, solution_str, ground_truth, extra_info=None, pid_dir=None):
    if "hang" in solution_str:
        if pid_dir:
            with open(os.path.join(pid_dir, "hung.pid"), "w") as f:
                f.write(str(os.getpid()))
        time.sleep(1e9)
    if "spin" in solution_str:
        while True:  # pure-Python infinite loop: no signal handler or sleep to rely on
            pass
    if "boom" in solution_str:
        raise ValueError("boom on purpose")
    return 1.0


# ---------------------------------------------------------------- batch manager
def test_batch_manager_calls_once_with_lists(tokenizer):
    calls = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        calls.append((data_sources, solution_strs, ground_truths, extra_infos))
        return [float(s.strip() == t) + bonus for s, t in zip(solution_strs, ground_truths)]

    batch = _batch(tokenizer, ["7", "8", "9"], ["7", "7", "9"], data_sources=["a", "a", "b"])
    manager = BatchRewardManager(tokenizer, batch_fn, reward_kwargs={"bonus": 0.5})
    scores, metrics = manager(batch)
    assert len(calls) == 1
    assert calls[0] == (["a", "a", "b"], ["7", "8", "9"], ["7", "7", "9"], [{"index": i} for i in range(3)])
    assert _placed(scores, batch) == [1.5, 0.5, 1.5]
    assert metrics["reward/a/score/mean"] == 1.0 and metrics["reward/b/score/mean"] == 1.5
    assert metrics["reward/errors"] == 0.0


def test_decode_reads_masked_tokens_of_each_row(tokenizer):
    """Multi-turn masks have holes (observation tokens): each row decodes only its response_mask tokens, an
    empty row decodes to "" and scores nothing, and the score sits on the row's last masked token."""
    seen = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos):
        seen.extend(solution_strs)
        return [0.25 * (i + 1) for i in range(len(solution_strs))]

    batch = _batch(tokenizer, ["1 2 3 4", "5 6", "", "7 8 9"], ["0"] * 4)
    mask = batch.response_mask.clone()
    mask[0, 1:3] = 0  # an observation in the middle of row 0
    mask[2] = 0  # row 2: nothing sampled
    mask[3, 0] = 0  # row 3 starts with an observation
    batch.response_mask = mask
    scores, metrics = BatchRewardManager(tokenizer, batch_fn)(batch)
    want = [
        tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
        for r, m in zip(batch.responses, mask)
    ]
    assert seen == want and seen[2] == "" and seen[0] != "1 2 3 4"
    last = [max((j for j in range(TR) if mask[i, j]), default=None) for i in range(4)]
    expected = torch.zeros(4, TR)
    for i, j in enumerate(last):
        if j is not None:
            expected[i, j] = 0.25 * (i + 1)
    assert torch.equal(scores, expected)
    assert metrics["reward/empty_responses"] == 1.0


def test_batch_manager_dicts_default_and_errors(tokenizer):
    batch = _batch(tokenizer, ["is 7", "is 8"], ["7", "7"])
    scores, metrics = BatchRewardManager(tokenizer)(batch)  # default: the built-in rules per sample
    assert _placed(scores, batch) == [1.0, 0.0]

    def with_dicts(data_sources, solution_strs, ground_truths, extra_infos):
        return [{"score": 2.0, "acc": 1.0}, {"score": -1.0, "acc": 0.0}]

    scores, metrics = BatchRewardManager(tokenizer, with_dicts)(batch)
    assert _placed(scores, batch) == [2.0, -1.0] and metrics["reward/extra/acc/mean"] == 0.5

    def too_few(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    with pytest.raises(RuntimeError, match="returned 1 results for 2 samples"):
        BatchRewardManager(tokenizer, too_few)(batch)

    def failing(**kwargs):
        raise KeyError("nope")

    with pytest.raises(RuntimeError, match="batch reward function failed") as info:
        BatchRewardManager(tokenizer, failing)(batch)
    assert isinstance(info.value.__cause__, KeyError)
    scores, metrics = BatchRewardManager(tokenizer, failing, on_error="zero")(batch)
    assert scores.abs().sum().item() == 0.0 and metrics["reward/errors"] == 2.0


# ---------------------------------------------------------------- dapo
def test_overlong_penalty_formula():
    # L=20, L_b=8: free up to 12 tokens, then linear down to -factor at 20.
    assert overlong_penalty(12, 20, 8, 0.5) == 0.0
    assert overlong_penalty(16, 20, 8, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 8, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(30, 20, 8, 0.5) == pytest.approx(-0.5)  # capped at -factor


def test_dapo_overlong_penalty_hand_computed(tokenizer):
    # L = 20 (TR), L_b = 8, factor 0.5 => penalty = -min((l - 12) / 8, 1) * 0.5
    lengths = [10, 16, 20, 0]
    expected_penalty = [0.0, -0.25, -0.5, 0.0]  # 10 <= 12; (16-12)/8*0.5; (20-12)/8 = 1 -> 0.5; empty
    batch = _batch(tokenizer, ["x"] * 4, ["1"] * 4, lengths=lengths)
    manager = DAPORewardManager(
        tokenizer,
        lambda **kw: 1.0,
        overlong_buffer_enable=True,
        overlong_buffer_len=8,
        overlong_penalty_factor=0.5,
        max_response_length=TR,
    )
    scores, metrics = manager(batch)
    assert _placed(scores, batch) == pytest.approx([1.0, 0.75, 0.5, 0.0])
    assert scores[3].abs().sum().item() == 0.0
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(sum(expected_penalty) / 4)
    assert metrics["reward/score/mean"] == pytest.approx((1.0 + 0.75 + 0.5) / 4)

    # L defaults to the response width; a smaller configured L moves the buffer.
    shorter = DAPORewardManager(
        tokenizer,
        lambda **kw: 1.0,
        overlong_buffer_enable=True,
        overlong_buffer_len=4,
        overlong_penalty_factor=1.0,
        max_response_length=16,
    )
    scores, _ = shorter(batch)  # free up to 12: 10 -> 0, 16 -> -1, 20 -> -1 (capped)
    assert _placed(scores, batch) == pytest.approx([1.0, 0.0, 0.0, 0.0])

    off = DAPORewardManager(tokenizer, lambda **kw: 1.0)
    scores, metrics = off(batch)
    assert _placed(scores, batch) == [1.0, 1.0, 1.0, 0.0] and metrics["reward/overlong_penalty/mean"] == 0.0


def test_dapo_rejects_bad_buffer(tokenizer):
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        DAPORewardManager(tokenizer, overlong_buffer_enable=True, overlong_buffer_len=0)
    with pytest.raises(ValueError, match="exceeds the max response length"):
        DAPORewardManager(
            tokenizer, overlong_buffer_enable=True, overlong_buffer_len=64, max_response_length=32
        )


# ---------------------------------------------------------------- naive: on_error, metrics
def test_exception_in_one_sample_zero_scores_only_that_sample(tokenizer):
    batch = _batch(tokenizer, ["ok", "boom", "ok"], ["1", "1", "1"], data_sources=["a", "a", "b"])
    scores, metrics = NaiveRewardManager(tokenizer, _echo_scorer, on_error="zero")(batch)
    assert _placed(scores, batch) == [1.0, 0.0, 1.0]
    assert metrics["reward/errors"] == 1.0 and metrics["reward/timeouts"] == 0.0
    assert metrics["reward/a/score/mean"] == 0.5 and metrics["reward/b/score/mean"] == 1.0
    with pytest.raises(RuntimeError, match="sample 1") as info:
        NaiveRewardManager(tokenizer, _echo_scorer)(batch)
    assert "'a'" in str(info.value) and isinstance(info.value.__cause__, ValueError)


def test_single_source_metric_and_reward_kwargs(tokenizer):
    batch = _batch(tokenizer, ["is 7", "is 8"], ["7", "7"])
    scores, metrics = NaiveRewardManager(tokenizer, reward_kwargs={"format_score": 0.1})(batch)
    assert _placed(scores, batch) == pytest.approx([1.0, 0.1])
    assert metrics["reward/arithmetic/score/mean"] == pytest.approx(0.55)


# ---------------------------------------------------------------- naive/dapo in worker processes
def test_pool_matches_inline_and_is_reused(tokenizer):
    batch = _batch(tokenizer, ["is 7", "is 8", "", "is 9", "is 1"], ["7", "7", "0", "9", "2"])
    inline_scores, inline_metrics = NaiveRewardManager(tokenizer)(batch)
    manager = NaiveRewardManager(tokenizer, num_workers=2, mp_context="fork")
    try:
        scores, metrics = manager(batch)
        pids = manager.pool.pids()
        again, _ = manager(batch)
        assert manager.pool.pids() == pids and len(pids) == 2  # same workers serve the next step
    finally:
        manager.close()
    assert torch.equal(scores, inline_scores) and torch.equal(again, inline_scores)
    assert metrics == inline_metrics
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # close() stopped (and reaped) the workers


@pytest.mark.parametrize("hang", ["hang", "spin"])
def test_hanging_sample_is_cut_off_and_counted(tokenizer, tmp_path, hang):
    batch = _batch(tokenizer, ["ok", hang, "ok", "ok"], ["1"] * 4, data_sources=["a", "slow", "a", "a"])
    manager = NaiveRewardManager(
        tokenizer,
        _echo_scorer,
        num_workers=2,
        timeout_s=TIMEOUT_S,
        on_error="zero",
        mp_context="fork",
        reward_kwargs={"pid_dir": str(tmp_path)},
    )
    try:
        manager(_batch(tokenizer, ["ok"], ["1"]))  # start the workers outside the timed call
        start = time.monotonic()
        scores, metrics = manager(batch)
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT_S + SLACK_S, elapsed
        assert _placed(scores, batch) == [1.0, 0.0, 1.0, 1.0]
        assert metrics["reward/errors"] == 1.0 and metrics["reward/timeouts"] == 1.0
        assert metrics["reward/slow/score/mean"] == 0.0
        if hang == "hang":  # the hung worker was killed and reaped, not left running
            hung_pid = int((tmp_path / "hung.pid").read_text())
            with pytest.raises(ProcessLookupError):
                os.kill(hung_pid, 0)
            assert hung_pid not in manager.pool.pids()
        # The run goes on: the next step is scored normally by a replacement worker.
        after = _batch(tokenizer, ["ok", "ok", "ok"], ["1"] * 3)
        scores, metrics = manager(after)
        assert _placed(scores, after) == [1.0, 1.0, 1.0] and metrics["reward/errors"] == 0.0
        assert manager.pool.num_alive == 2
    finally:
        manager.close()


def test_hanging_sample_raises_with_index(tokenizer):
    batch = _batch(tokenizer, ["ok", "ok", "hang"], ["1"] * 3, data_sources=["a", "a", "slow"])
    manager = DAPORewardManager(
        tokenizer, _echo_scorer, num_workers=2, timeout_s=TIMEOUT_S, on_error="raise", mp_context="fork"
    )
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            manager(batch)
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S + 5.0  # incl. starting two workers
        msg = str(info.value)
        assert "sample 2" in msg and "'slow'" in msg and "timed out" in msg
        assert isinstance(info.value.__cause__, TimeoutError)
    finally:
        manager.close()


def test_worker_exception_and_crash(tokenizer):
    def crash_or_fail(data_source, solution_str, ground_truth, extra_info=None):
        if "crash" in solution_str:
            os._exit(3)
        if "boom" in solution_str:
            raise ZeroDivisionError("bad math")
        return 0.5

    batch = _batch(tokenizer, ["ok", "crash", "boom", "ok"], ["1"] * 4)
    manager = NaiveRewardManager(tokenizer, crash_or_fail, num_workers=2, on_error="zero", mp_context="fork")
    try:
        scores, metrics = manager(batch)
        assert _placed(scores, batch) == [0.5, 0.0, 0.0, 0.5]
        assert metrics["reward/errors"] == 2.0 and metrics["reward/timeouts"] == 0.0
    finally:
        manager.close()
    strict = NaiveRewardManager(tokenizer, crash_or_fail, num_workers=1, mp_context="fork")
    try:
        with pytest.raises(RuntimeError, match=r"sample 2 .*ZeroDivisionError: bad math"):
            strict(_batch(tokenizer, ["ok", "ok", "boom"], ["1"] * 3))
        with pytest.raises(RuntimeError, match=r"sample 0 .*exit code 3"):
            strict(_batch(tokenizer, ["crash"], ["1"]))
    finally:
        strict.close()


def test_file_function_in_forkserver_workers(tokenizer, tmp_path):
    """The default start method: a clean worker imports the user's file itself, by path."""
    path = tmp_path / "slow_reward.py"
    path.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if 'hang' in solution_str:\n"
        "        time.sleep(1e9)\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    manager = NaiveRewardManager(
        tokenizer, FileRewardFunction(path), num_workers=1, timeout_s=TIMEOUT_S, on_error="zero"
    )
    assert manager.mp_context == "forkserver"
    try:
        batch = _batch(tokenizer, ["7", "hang", "8"], ["7", "1", "7"])
        scores, metrics = manager(batch)
        assert _placed(scores, batch) == [1.0, 0.0, 0.0] and metrics["reward/timeouts"] == 1.0
    finally:
        manager.close()


def test_unpicklable_function_with_spawn_explains(tokenizer):
    manager = NaiveRewardManager(tokenizer, lambda **kw: 1.0, num_workers=1, mp_context="spawn")
    with pytest.raises(TypeError, match="picklable"):
        manager(_batch(tokenizer, ["ok"], ["1"]))
    manager.close()


# ---------------------------------------------------------------- build_reward_manager
def _config(**reward_model):
    return OmegaConf.create(
        {
            "data": {"max_response_length": 16},
            "reward_model": {"reward_manager": "naive", **reward_model},
            "custom_reward_function": {"path": None, "name": "compute_score"},
        }
    )


def test_build_reward_manager_kinds(tokenizer, tmp_path):
    manager = build_reward_manager(_config(), tokenizer)
    assert type(manager) is NaiveRewardManager and manager.num_workers == 0 and manager.on_error == "raise"
    assert manager.timeout_s == 10.0 and manager.mp_context == "forkserver"
    manager = build_reward_manager(OmegaConf.create({"reward_model": {"reward_manager": "naive"}}), tokenizer)
    assert type(manager) is NaiveRewardManager  # every new key is optional

    manager = build_reward_manager(
        _config(
            reward_manager="dapo",
            num_workers=2,
            timeout_s=3,
            on_error="zero",
            mp_context="fork",
            reward_kwargs={"format_score": 0.1},
            overlong_buffer={"enable": True, "len": 4, "penalty_factor": 0.5},
        ),
        tokenizer,
    )
    assert type(manager) is DAPORewardManager
    assert (manager.num_workers, manager.timeout_s, manager.on_error, manager.mp_context) == (
        2,
        3,
        "zero",
        "fork",
    )
    assert manager.reward_kwargs == {"format_score": 0.1}
    assert (manager.overlong_buffer_enable, manager.overlong_buffer_len, manager.overlong_penalty_factor) == (
        True,
        4,
        0.5,
    )
    assert manager.max_response_length == 16

    calls = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(len(solution_strs))
        return [0.25] * len(solution_strs)

    manager = build_reward_manager(_config(reward_manager="batch"), tokenizer, compute_score=batch_fn)
    assert type(manager) is BatchRewardManager
    batch = _batch(tokenizer, ["a", "b", "c"], ["1"] * 3)
    scores, _ = manager(batch)
    assert calls == [3] and _placed(scores, batch) == [0.25] * 3


def test_build_reward_manager_custom_file(tokenizer, tmp_path):
    path = tmp_path / "reward_fn.py"
    path.write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 3.0, 'len': len(solution_str)}\n"
    )
    cfg = _config()
    cfg.custom_reward_function.path = str(path)
    cfg.custom_reward_function.name = "my_score"
    manager = build_reward_manager(cfg, tokenizer)
    assert isinstance(manager.compute_score, FileRewardFunction)
    batch = _batch(tokenizer, ["abc"], ["1"])
    scores, metrics = manager(batch)
    assert _placed(scores, batch) == [3.0] and metrics["reward/extra/len/mean"] == 3.0

    cfg.custom_reward_function.name = "compute_score"
    with pytest.raises(AttributeError, match="reward_fn.py.*'compute_score'"):
        build_reward_manager(cfg, tokenizer)
    cfg.custom_reward_function.path = str(tmp_path / "missing.py")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        build_reward_manager(cfg, tokenizer)


@pytest.mark.parametrize(
    "reward_model, key",
    [
        ({"reward_manager": "prime"}, "reward_model.reward_manager"),
        ({"on_error": "ignore"}, "reward_model.on_error"),
        ({"num_workers": -1}, "reward_model.num_workers"),
        ({"timeout_s": 0}, "reward_model.timeout_s"),
        ({"mp_context": "thread"}, "reward_model.mp_context"),
        ({"reward_kwargs": [1]}, "reward_model.reward_kwargs"),
        ({"overlong_buffer": {"enable": True}}, "reward_model.overlong_buffer.enable"),
        ({"reward_manager": "dapo", "overlong_buffer": {"enable": True, "len": 64}}, "overlong_buffer.len"),
    ],
)
def test_build_reward_manager_rejects_bad_values(tokenizer, reward_model, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_reward_manager(_config(**reward_model), tokenizer)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (a container's init may not reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_idle_worker_killed_from_outside_is_replaced(tokenizer):
    manager = NaiveRewardManager(tokenizer, _echo_scorer, num_workers=1, mp_context="fork")
    try:
        batch = _batch(tokenizer, ["ok", "ok"], ["1", "1"])
        manager(batch)
        (pid,) = manager.pool.pids()
        os.kill(pid, 9)
        time.sleep(0.2)
        scores, metrics = manager(batch)
        assert _placed(scores, batch) == [1.0, 1.0] and metrics["reward/errors"] == 0.0
        assert manager.pool.pids() != [pid]
    finally:
        manager.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_hung_worker_dies_with_its_driver(tmp_path):
    """A driver killed mid-step (SIGKILL: no cleanup runs) takes its hung worker with it."""
    import subprocess
    import sys

    pid_file = tmp_path / "worker.pid"
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, sys, time\n"
        "from fusedrl.rewards.pool import ScoringPool\n"
        "def hang(path):\n"
        "    open(path, 'w').write(str(os.getpid()))\n"
        "    while True:\n"
        "        pass\n"
        "if __name__ == '__main__':\n"
        "    ScoringPool(hang, 1, timeout_s=None, mp_context='fork').map([{'path': sys.argv[1]}])\n"
    )
    driver = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker_pid = int(pid_file.read_text())
        assert not _gone(worker_pid)
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 10
    while not _gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = _gone(worker_pid)
    if not gone:  # do not leave a spinning orphan behind when this fails
        os.kill(worker_pid, 9)
    assert gone
