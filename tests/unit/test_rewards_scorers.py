"""Built-in rule scorers (gsm8k, math, countdown), their dispatch, and loading a user's reward file."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from fusedrl.rewards import countdown, default_compute_score, gsm8k, load_custom_reward_function, math_boxed
from fusedrl.rewards.custom import FileRewardFunction


# ---------------------------------------------------------------- gsm8k
@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("#### 1,234", "1234", 1.0),
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("#### 72.0", "72", 1.0),
        ("#### 72.", "72", 1.0),
        ("#### $1,000", "1000", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 5 no wait\n#### 6", "6", 1.0),  # the last #### counts
        ("#### 6 no wait\n#### 5", "6", 0.0),
        ("#### 71", "72", 0.0),
        ("The answer is 72", "72", 0.0),  # no ####
        ("####", "72", 0.0),
        ("#### seventy-two", "72", 0.0),
        ("#### 1234", "reasoning... #### 1,234", 1.0),  # raw GSM8K answer as ground truth
        ("#### 1234", 1234, 1.0),
    ],
)
def test_gsm8k(response, truth, expected):
    assert gsm8k.compute_score(response, truth) == expected


def test_gsm8k_format_score_and_bad_truth():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no marker", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 72", "72", format_score=0.1) == 1.0
    assert gsm8k.extract_answer("x #### 1,234,567.5 y") == "1234567.5"
    with pytest.raises(ValueError, match="gsm8k ground_truth"):
        gsm8k.compute_score("#### 1", "one")


# ---------------------------------------------------------------- math (math_verify)
@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{\\sqrt{4}}}", "\\frac{1}{\\sqrt{4}}"),
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("\\boxed{1/2", None),
        ("no box", None),
        ("\\boxed", None),
    ],
)
def test_last_boxed(text, expected):
    assert math_boxed.last_boxed(text) == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
        ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),
        ("first \\boxed{4}, finally \\boxed{3}", "4", 0.0),
        ("\\boxed{x^2+1}", "1+x^2", 1.0),
        ("\\boxed{\\frac{1}{\\sqrt{4}}}", "\\boxed{\\frac12}", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("the answer is 1/2", "0.5", 0.0),  # no box
        ("\\boxed{1/2", "0.5", 0.0),  # unclosed box
    ],
)
def test_math(response, truth, expected):
    pytest.importorskip("math_verify")
    assert math_boxed.compute_score(response, truth) == expected


def test_math_format_score():
    pytest.importorskip("math_verify")
    assert math_boxed.compute_score("\\boxed{3}", "4", format_score=0.1) == 0.1
    assert math_boxed.compute_score("3", "4", format_score=0.1) == 0.0


def test_math_without_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match="pip install math-verify"):
        math_boxed.compute_score("\\boxed{1}", "1")
    with pytest.raises(ImportError, match="pip install math-verify"):
        default_compute_score("lighteval/MATH", "\\boxed{1}", "1")


# ---------------------------------------------------------------- countdown
TRUTH = {"target": 5, "numbers": [2, 2, 5]}


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>hmm</think> <answer>5 * 2 / 2</answer>", 1.0),
        ("<answer>(2 + 2) - 4 + 5</answer>", 0.0),  # 4 is not given
        ("<answer>5 * (2 / 2)</answer>", 1.0),
        ("<answer>5 * 2 / 2 = 5</answer>", 1.0),  # "= target" suffix allowed
        ("<answer>5 * 2 / 2 = 6</answer>", 0.0),
        ("<answer>5 + 2 + 2</answer>", 0.0),  # wrong value
        ("<answer>5 * 2 / 2 * 2</answer>", 0.0),  # 2 used three times
        ("<answer>5</answer>", 0.0),  # 2 and 2 unused
        ("<answer>5 / (2 - 2)</answer>", 0.0),  # division by zero
        ("<answer>-2 + 2 + 5</answer>", 0.0),  # unary minus is not an operator of the game
        ("<answer>5 * 2.0 / 2</answer>", 0.0),  # floats are not given numbers
        ("<answer>(5 * 2) ** 1 / 2</answer>", 0.0),  # power
        ("<answer>5 // 2 * 2</answer>", 0.0),
        ("<answer>1 + 1</answer> no, <answer>5 * 2 / 2</answer>", 1.0),  # the last answer counts
        ("<answer>5 * 2 / 2</answer> no, <answer>1 + 1</answer>", 0.0),
        ("5 * 2 / 2", 0.0),  # no <answer>
        ("<answer>" + "(" * 300 + "5" + ")" * 300 + "</answer>", 0.0),  # too long / too nested
        ("<answer>5 * 2 / 2</answer", 0.0),
    ],
)
def test_countdown(response, expected):
    assert countdown.compute_score(response, TRUTH) == expected


def test_countdown_is_exact_not_floating_point():
    truth = {"target": 24, "numbers": [1, 3, 4, 6]}
    assert countdown.compute_score("<answer>6 / (1 - 3 / 4)</answer>", truth) == 1.0
    value, used = countdown.evaluate_equation("6 / (1 - 3 / 4)")
    assert value == 24 and used == [6, 1, 3, 4]


@pytest.mark.parametrize(
    "truth",
    [
        TRUTH,
        json.dumps(TRUTH),
        str(TRUTH),  # what RolloutBatch.from_prompts makes of a dict: its Python repr
        "{'target': 5, 'numbers': array([2, 2, 5])}",  # a pandas/numpy row's repr
        "{'target': 5, 'numbers': array([2, 2, 5], dtype=int64)}",
    ],
)
def test_countdown_ground_truth_forms(truth):
    assert countdown.parse_ground_truth(truth) == (5, [2, 2, 5])
    assert countdown.compute_score("<answer>5 * 2 / 2</answer>", truth) == 1.0


@pytest.mark.parametrize("truth", ["5", "{'target': 5}", "not a dict", {"target": "x", "numbers": [1]}])
def test_countdown_bad_ground_truth(truth):
    with pytest.raises(ValueError, match="countdown ground_truth"):
        countdown.compute_score("<answer>1</answer>", truth)


@pytest.mark.parametrize(
    "payload",
    [
        "__import__('os').system('touch {marker}')",
        "open('{marker}', 'w').write('x')",
        "[c for c in ().__class__.__base__.__subclasses__()]",
        "(lambda: __import__('os').system('touch {marker}'))()",
        "5 * 2 / 2 if __import__('os').system('touch {marker}') else 5",
    ],
)
def test_countdown_never_executes_the_answer(tmp_path, payload):
    marker = tmp_path / "pwned"
    response = f"<answer>{payload.format(marker=marker)}</answer>"
    assert countdown.compute_score(response, TRUTH) == 0.0
    assert countdown.compute_score(response, TRUTH, format_score=0.1) == 0.1
    assert not marker.exists()


def test_countdown_format_score():
    assert countdown.compute_score("<answer>5 + 2 + 2</answer>", TRUTH, format_score=0.1) == 0.1
    assert countdown.compute_score("no answer tag", TRUTH, format_score=0.1) == 0.0


# ---------------------------------------------------------------- dispatch
@pytest.mark.parametrize(
    "data_source, response, truth, expected",
    [
        ("arithmetic", "is 68", "68", 1.0),
        ("openai/gsm8k", "#### 1,234", "1234", 1.0),
        ("gsm8k", "#### 1,233", "1234", 0.0),
        ("countdown", "<answer>5 * 2 / 2</answer>", json.dumps(TRUTH), 1.0),
        ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{2}", "2", 1.0),
        ("HuggingFaceH4/MATH-500", "\\boxed{3}", "2", 0.0),
        ("math", "\\boxed{2}", "2", 1.0),
    ],
)
def test_default_compute_score_dispatch(data_source, response, truth, expected):
    if data_source not in ("arithmetic", "openai/gsm8k", "gsm8k", "countdown"):
        pytest.importorskip("math_verify")
    assert default_compute_score(data_source, response, truth, extra_info={"index": 0}) == expected


def test_default_compute_score_passes_format_score():
    assert default_compute_score("gsm8k", "#### 1", "2", format_score=0.25) == 0.25
    assert default_compute_score("arithmetic", "is 1", "2", format_score=0.25) == 0.25
    assert default_compute_score("arithmetic", "no number", "2", format_score=0.25) == 0.0
    assert default_compute_score("countdown", "<answer>1</answer>", TRUTH, format_score=0.25) == 0.25


# ---------------------------------------------------------------- custom reward files
REWARD_FILE = """
CALLS = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)

def by_length(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str), "chars": len(solution_str)}

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_load_custom_reward_function(reward_file):
    fn = load_custom_reward_function(reward_file)
    assert fn("x", " 42 ", "42", None) == 1.0 and fn.__name__ == "compute_score"
    assert load_custom_reward_function(str(reward_file), None)("x", "41", "42", {}) == 0.0
    assert load_custom_reward_function(reward_file, "by_length")("x", "abc", "", {}) == {
        "score": 3,
        "chars": 3,
    }


def test_load_custom_reward_function_errors(tmp_path, reward_file):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_custom_reward_function(missing)
    with pytest.raises(AttributeError) as info:
        load_custom_reward_function(reward_file, "score_it")
    assert "my_reward.py" in str(info.value) and "'score_it'" in str(info.value)
    assert "by_length" in str(info.value)  # lists what the file does define
    with pytest.raises(TypeError, match="NOT_A_FUNCTION"):
        load_custom_reward_function(reward_file, "NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match="broken.py") as info:
        load_custom_reward_function(broken)
    assert isinstance(info.value.__cause__, SyntaxError)
    failing = tmp_path / "failing.py"
    failing.write_text("import no_such_module_for_fusedrl_tests\n")
    with pytest.raises(ImportError, match="failing.py"):
        load_custom_reward_function(failing)


def test_file_reward_function_pickles_by_path(reward_file):
    ref = FileRewardFunction(reward_file, "by_length")
    assert ref("x", "abcd", "", {}) == {"score": 4, "chars": 4}
    payload = pickle.dumps(ref)
    assert str(reward_file).encode() in payload and len(payload) < 500  # the path, not the code
    copy = pickle.loads(payload)
    assert copy.name == "by_length" and copy("x", "ab", "", {}) == {"score": 2, "chars": 2}
    with pytest.raises(FileNotFoundError):
        FileRewardFunction(reward_file.parent / "gone.py").load()
