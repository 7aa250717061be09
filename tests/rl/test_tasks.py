"""RL tasks: deterministic prompts, the digit rewards, the math verifier, pluggable rewards, the registry."""
import json
import sys

import pytest

from dsv4.rl import tasks as T
from dsv4.rl.api import SamplingParams
from dsv4.rl.tasks import (CopyTask, EchoTask, MathTask, RewardError, RewardSpecError, Sample, extract_final_answer,
                           load_reward, make_task, math_reward, normalize_answer, score)
from dsv4.tokenizer import Tokenizer


# ------------------------------------------------------------------------------------------ digit tasks
def test_echo_prompts_are_digits_and_deterministic():
    task = EchoTask(prompt_len=5)
    a = task.prompts(step=3, n=16, seed=7)
    assert len(a) == 16 and all(len(s.prompt_ids) == 5 for s in a)
    assert all(48 <= t <= 57 for s in a for t in s.prompt_ids)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in EchoTask(prompt_len=5).prompts(3, 16, 7)]
    assert [s.prompt_ids for s in a[:4]] == [s.prompt_ids for s in task.prompts(3, 4, 7)]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in task.prompts(4, 16, 7)]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in task.prompts(3, 16, 8)]
    assert all(s.answer == s.prompt_ids[-1:] for s in a)
    assert len({tuple(s.prompt_ids) for s in a}) > 8  # seeded, not constant


def test_echo_reward_and_sampling():
    task = EchoTask(prompt_len=3, prefix_ids=(256,))
    s = Sample([256, 52, 49, 55], [55])  # "417" -> answer "7"
    assert task.prompts(0, 1, 0)[0].prompt_ids[0] == 256
    assert task.reward(s, [55]) == 1.0
    assert task.reward(s, [49]) == 0.0  # the first digit, not the last
    assert task.reward(s, [55 - 48]) == 0.0  # the digit's value is not its byte id
    assert task.reward(s, []) == 0.0
    assert task.allowed_token_ids == list(range(48, 58)) and task.max_new_tokens == 1
    params = T.sampling_params(task, temperature=0.8)
    assert SamplingParams.parse(params).allowed_token_ids == list(range(48, 58))  # the engine accepts it
    assert EchoTask(num_digits=3).allowed_token_ids == [48, 49, 50]
    assert {t for s in EchoTask(num_digits=3).prompts(0, 50, 0) for t in s.prompt_ids} == {48, 49, 50}


def test_copy_reward():
    task = CopyTask(prompt_len=6, k=3)
    s = task.prompts(0, 1, 0)[0]
    assert s.answer == s.prompt_ids[:3] and task.max_new_tokens == 3
    wrong = [48 + (t - 48 + 1) % 10 for t in s.answer]
    assert task.reward(s, s.answer) == 1.0
    assert task.reward(s, [s.answer[0]] + wrong[1:]) == pytest.approx(1 / 3)
    assert task.reward(s, wrong) == 0.0
    assert task.reward(s, s.answer[:2]) == pytest.approx(2 / 3)  # a short response loses the missing ones
    assert CopyTask(prompt_len=6, k=3, exact=True).reward(s, [s.answer[0]] + wrong[1:]) == 0.0
    with pytest.raises(ValueError, match="k must be"):
        CopyTask(prompt_len=2, k=3)


# ------------------------------------------------------------------------------------------ math verifier
@pytest.mark.parametrize("text,expected", [
    ("so the total is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{3}{4}}", "3/4"),                                # nested braces
    ("\\boxed{\\dfrac{1}{2}} of the cake", "1/2"),
    ("first \\boxed{3}, no wait: \\boxed{4}", "4"),                   # the last box
    ("\\boxed{7} then a cut-off \\boxed{12", "7"),                      # an unclosed box is skipped
    ("\\boxed{x = 5}", "5"),
    ("Step 1 ... so 3 + 4 = 7\n#### 1,234", "1234"),
    ("#### 42 apples", "42"),
    ("The answer is 42.", "42"),
    ("The final answer is: $-7$.", "-7"),
    ("the answer is 3.50 dollars", "7/2"),
    ("The answer is 12, and checking: 3*4 = 12 with 99 left", "12"),  # a stated answer beats the last number
    ("We get 5 apples, then 12 more, so 17 apples in all.", "17"),     # last number fallback
    ("<think>maybe \\boxed{3}? or 8</think>The answer is \\boxed{5}", "5"),
    ("<think>it is 9</think>I am not sure.", None),                     # reasoning numbers do not count
    ("7 - 3 = 4", "4"),
    ("so the change is 10-3", "3"),                                    # a binary minus is not a sign
    ("I don't know", None),
    ("The answer isn't obvious, but 6 works", "6"),                    # "isn't" is not "is"
    ("Put it in \\boxed{}. #### 8", "8"),                              # an empty box is no answer
])
def test_extract_final_answer(text, expected):
    got = extract_final_answer(text)
    if expected is None:
        assert got is None
    else:
        assert got is not None and normalize_answer(got) == normalize_answer(expected), got


@pytest.mark.parametrize("a,b,same", [
    ("1,234", "1234", True), ("42.0", "42", True), ("+5", "5", True), (" 1 / 2 ", "0.5", True),
    ("\\frac{2}{4}", "1/2", True), ("-\\frac{1}{2}", "-0.5", True), ("1,234,567", "1234567", True),
    ("\u22123", "-3", True), ("25%", "25", True), ("1/3", "0.333", False), ("41", "42", False),
    ("5", "-5", False), ("Paris", " paris ", True), ("1,23", "123", False),
])
def test_normalize_answer(a, b, same):
    assert (normalize_answer(a) == normalize_answer(b)) is same


def test_math_reward():
    assert math_reward("so \\boxed{105}", "105") == 1.0
    assert math_reward("so \\boxed{104}", "105") == 0.0
    assert math_reward("#### 0.5", "1/2") == 1.0
    assert math_reward("", "1") == 0.0


def test_math_smoke_file_matches_generator():
    assert T.MATH_SMOKE_PATH.read_text() == T.math_smoke_text()
    rows = T.load_math_problems()
    assert len(rows) == 40 and len({r["question"] for r in rows}) == 40
    # the answers are right: re-derive the plain arithmetic ones from the question text
    for r in rows:
        q = r["question"]
        if q.startswith("What is ") and " + " in q and "/" not in q:
            a, b = q[len("What is "):-1].split(" + ")
            assert int(r["answer"]) == int(a) + int(b)
        if "% of " in q:
            pct, base = q[len("What is "):-1].split("% of ")
            assert int(r["answer"]) * 100 == int(pct) * int(base)


def test_load_math_problems_errors(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question": "q", "answer": 1}\n{"answer": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        T.load_math_problems(p)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        T.load_math_problems(tmp_path / "missing.jsonl")


def test_math_task_prompts_and_reward():
    task = MathTask()
    tok = Tokenizer()
    a = task.prompts(step=0, n=25, seed=1)
    b = task.prompts(step=1, n=25, seed=1)
    # epoch 0 is a permutation: steps 0 and the first 15 of step 1 cover all 40 problems once
    first_epoch = [s.meta["id"] for s in a + b[:15]]
    assert len(set(first_epoch)) == 40
    assert [s.meta["id"] for s in b] == [s.meta["id"] for s in MathTask().prompts(1, 25, 1)]
    s = a[0]
    text = tok.decode(s.prompt_ids)
    assert text.startswith("<｜begin▁of▁sentence｜><｜User｜>" + s.meta["question"])
    assert text.endswith("<｜Assistant｜></think>") and "\\boxed{}" in text
    good = tok.encode(f"Working... so \\boxed{{{s.answer}}}") + [tok.eos_id]
    assert task.reward(s, good) == 1.0
    assert task.reward(s, tok.encode("\\boxed{999999}")) == 0.0
    assert task.stop_token_ids == [tok.eos_id] and task.allowed_token_ids is None
    assert MathTask(chat=False, instruction="").prompt_text("What is 1 + 1?") == "What is 1 + 1?"


# ------------------------------------------------------------------------------------------ pluggable rewards
def good_reward(sample, response_ids):
    return float(len(response_ids))


def raising_reward(sample, response_ids):
    if response_ids and response_ids[0] == 13:
        raise KeyError("no rule for 13")
    return 0.0


NOT_CALLABLE = 3


def test_load_reward_forms():
    assert load_reward(f"{__name__}:good_reward") is good_reward
    assert load_reward(f"{__name__}.good_reward") is good_reward
    assert load_reward("dsv4.rl.tasks:math_reward") is math_reward


@pytest.mark.parametrize("spec,match", [
    ("no_such_pkg_xyz.rewards:fn", "no module named 'no_such_pkg_xyz'"),
    ("dsv4.rl.no_such_module:fn", "no module named 'dsv4.rl.no_such_module'"),
    ("dsv4.rl.tasks:math_rewrd", "has no attribute 'math_rewrd'. Did you mean 'math_reward'"),
    ("dsv4.rl.tasks:MATH_SMOKE_PATH", "not a function"),
    ("justaname", "not a module and a function name"),
    ("", "empty"),
])
def test_load_reward_errors(spec, match):
    with pytest.raises(RewardSpecError, match=match) as e:
        load_reward(spec)
    assert repr(spec) in str(e.value)


def test_load_reward_missing_dependency(tmp_path, monkeypatch):
    (tmp_path / "rl_reward_needs_dep.py").write_text("import not_installed_dep_xyz\n\ndef fn(s, r):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardSpecError, match="needs 'not_installed_dep_xyz'"):
        load_reward("rl_reward_needs_dep:fn")
    sys.modules.pop("rl_reward_needs_dep", None)


def test_score_names_the_failing_sample():
    samples = [Sample([1, 2], [0], {"text": "first prompt"}), Sample([3], [0], {"question": "Q" * 200})]
    assert score(good_reward, samples, [[1, 2, 3], []]) == [3.0, 0.0]
    with pytest.raises(RewardError) as e:
        score(raising_reward, samples, [[1], [13]])
    err = e.value
    assert err.index == 1 and "sample 1" in str(err) and "no rule for 13" in str(err)
    assert isinstance(err.__cause__, KeyError) and err.original is err.__cause__
    assert err.prompt.startswith("QQQ") and len(err.prompt) <= 80  # shortened
    with pytest.raises(RewardError, match="returned None"):
        score(lambda s, r: None, samples, [[1], [2]])
    with pytest.raises(RewardError, match="sample 0.*finite"):
        score(lambda s, r: float("nan"), samples, [[1], [2]])
    with pytest.raises(ValueError, match="2 samples but 1 responses"):
        score(good_reward, samples, [[1]])


# ------------------------------------------------------------------------------------------ registry
def test_make_task():
    assert isinstance(make_task("echo", prompt_len=6), EchoTask)
    assert make_task("copy", k=2).max_new_tokens == 2
    assert set(T.TASKS) == {"echo", "copy", "math"}
    assert all(isinstance(make_task(n), T.Task) for n in T.TASKS)
    with pytest.raises(ValueError, match="Did you mean 'echo'"):
        make_task("ecko")
    with pytest.raises(ValueError, match="unknown RL task 'gsm8k'.*echo, copy, math"):
        make_task("gsm8k")
    with pytest.raises(ValueError, match="no parameter 'lenght'.*prompt_len"):
        make_task("echo", lenght=3)


def test_math_smoke_rows_are_json_objects():
    for line in T.MATH_SMOKE_PATH.read_text().splitlines():
        row = json.loads(line)
        assert set(row) == {"id", "question", "answer"} and normalize_answer(row["answer"]) == row["answer"]
