"""Tasks: synthetic addition, and GSM8K / MATH through datasets.load_dataset from local files."""

import json

import pytest

from rpa.train.tasks import TaskError, TaskSpec, build_task, exact_int_reward, gsm8k_gold, math_verify_reward


def test_synthetic_add_rows_and_reward():
    task = build_task(TaskSpec(num_prompts=20, max_operand=9, seed=3))
    rows, reward = task.rows, task.reward
    assert len(rows) == 20 and reward is exact_int_reward
    a, b = (int(x) for x in rows[0]["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
    assert rows[0]["answer"] == str(a + b)
    assert reward(None, [" 12 and more", "x", " 7", "-3"], ["12", "12", "8", "-3"]) == [1.0, 0.0, 0.0, 1.0]
    assert build_task(TaskSpec(num_prompts=20, seed=3)).rows == rows  # deterministic in the seed
    assert task.eval_rows == [] and task.correct(" 7", "7") and not task.correct(" 17", "7")


def test_gsm8k_from_local_jsonl(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Q{i}: 2 + {i}?", "answer": f"work...\n#### {2 + i:,}"})
                              for i in range(1000, 1005)) + "\n")
    task = build_task(TaskSpec(name="gsm8k", path="json", data_files=str(data), num_prompts=3))
    rows, reward = task.rows, task.reward
    assert len(rows) == 3 and all(r["prompt"].endswith("\nAnswer:") for r in rows)
    gold = rows[0]["answer"]
    assert "," not in gold and int(gold) in range(1002, 1007)
    assert reward(None, [f"The answer is {gold}.", "The answer is 5."], [gold, gold]) == [1.0, 0.0]


def test_math_from_local_directory_uses_math_verify(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"problem": "Half of 1?",
                                                      "solution": "It is $\\boxed{\\frac{1}{2}}$."}) + "\n")
    task = build_task(TaskSpec(name="math", path=str(tmp_path), num_prompts=5))
    rows, reward = task.rows, task.reward
    assert len(rows) == 1 and reward is math_verify_reward
    assert reward(None, ["so the result is $\\boxed{0.5}$", "$\\boxed{2}$"], [rows[0]["answer"]] * 2) == [1.0, 0.0]


def test_bad_task_inputs_are_refused(tmp_path):
    with pytest.raises(TaskError, match="unknown task"):
        TaskSpec(name="gsm9k")
    with pytest.raises(TaskError, match="needs path"):
        TaskSpec(name="math")
    (tmp_path / "x.jsonl").write_text(json.dumps({"q": 1, "a": 2}) + "\n")
    with pytest.raises(TaskError, match="lacks column"):
        build_task(TaskSpec(name="gsm8k", path="json", data_files=str(tmp_path / "x.jsonl")))
    with pytest.raises(TaskError, match="####"):
        gsm8k_gold("no marker")


def test_count_task_long_answers_partial_reward_and_held_out_prompts():
    task = build_task(TaskSpec(name="count", num_prompts=10, length=32, eval_prompts=5, seed=1))
    row = task.rows[0]
    start, step = (int(x) for x in row["prompt"].removeprefix("count from ").rstrip(":").split(" by "))
    want = row["answer"].split()
    assert len(want) == 32 and want[0] == str((start + step) % 100) and want[-1] == str((start + 32 * step) % 100)
    half = " " + " ".join(want[:16] + ["0"] * 16)
    assert task.reward(None, [" " + row["answer"], half, "no"], [row["answer"]] * 3) == [1.0, sum(
        a == b for a, b in zip(want, want[:16] + ["0"] * 16)) / 32, 0.0]
    assert task.correct(" " + row["answer"], row["answer"]) and not task.correct(half, row["answer"])
    many = build_task(TaskSpec(name="count", num_prompts=500, eval_prompts=100, seed=1))
    assert len(task.eval_rows) == 5
    assert not {r["prompt"] for r in many.eval_rows} & {r["prompt"] for r in many.rows}  # held out


def test_eos_sanity_rewards_ending_at_once():
    task = build_task(TaskSpec(name="eos-sanity", num_prompts=4))
    assert task.reward(None, ["", "a b", "x"], completion_ids=[[2], [5, 6, 2], [7] * 10]) == [1.0, 1 / 3, 0.1]
    assert task.correct("", "", [2]) and not task.correct("a", "", [5, 2])


def test_walk_has_many_right_answers_and_scores_steps():
    """walk: any walk of +-1..3 steps is right, so the best policy can stay stochastic; the
    warm-start rows are random walks, several per start; held-out starts are not trained on."""
    from rpa.train.tasks import TaskSpec, build_task

    task = build_task(TaskSpec(name="walk", num_prompts=400, length=8, eval_prompts=50, seed=0))
    starts = {r["prompt"] for r in task.rows}
    assert len(starts) <= 80 and not starts & {r["prompt"] for r in task.eval_rows}
    answers = {}
    for r in task.rows:
        answers.setdefault(r["prompt"], set()).add(r["answer"])
    assert max(len(a) for a in answers.values()) > 1  # several right answers per prompt
    prompt = "walk from 98:"
    for completion, reward in [(" 99 1 4 2 99 96 95 97", 1.0), (" 0 1 2 3 4 5 6 7", 1.0), (" 0 5 6 7 8 9 10 11", 0.875),  # 98 -> 0: +2 ok
                               (" 99 1 4 9 10 11 12 13", 0.875), (" 50", 0.0), ("", 0.0),
                               (" 99 1 4 2 99 96 95 97 98 99", 1.0)]:
        assert task.reward([prompt], [completion], ["1 2 3 4 5 6 7 8"]) == [reward], completion
    assert task.correct(" 99 1 4 2 99 96 95 97", "1 2 3 4 5 6 7 8", prompt=prompt)
    assert not task.correct(" 99 1 4 2 99 96 95 97 98", "1 2 3 4 5 6 7 8", prompt=prompt)  # too long
    assert not task.correct(" 99 1 4 9 10 11 12 13", "1 2 3 4 5 6 7 8", prompt=prompt)
    with pytest.raises(ValueError, match="pass prompt="):
        task.correct(" 99", "1", None)


@pytest.mark.parametrize("completion,gold", [
    (" 5 + 3 = 8. #### 8\nQuestion: Tom has 2 apples and gets 2 more. How many?\nAnswer: 2 + 2 = 4 #### 4", "8"),
    (" She pays 3 * 4 = 12 dollars.\n#### 12\n\nQuestion: A train leaves at 3 pm ... #### 7", "12"),
    (" The answer is $\\boxed{8}$.\n\nProblem: compute 2+2.\nSolution: $\\boxed{4}$", "$\\boxed{8}$"),
    (" so $x = \\frac{1}{2}$. #### 1/2\nQuestion: what is 3 - 1?\nAnswer: #### 2", "$\\frac{1}{2}$"),
])
def test_math_answers_are_scored_on_the_first_answer_not_a_continuation(completion, gold):
    """A base model answers, then writes the next exercise; math-verify takes the last answer it
    finds, so the continuation's answer used to score the completion (0 for a right answer)."""
    from rpa.train.tasks import first_answer, math_verify_correct

    assert math_verify_reward(None, [completion], [gold]) == [1.0]
    assert math_verify_correct(completion, gold)
    # the control: scored on the whole text, the same completion is wrong
    assert math_verify_reward(None, [completion + "\n#### 999 \\boxed{999}"], [gold]) == [1.0]
    from math_verify import parse, verify
    assert not verify(parse(gold if "$" in gold else f"${gold}$"), parse(completion))
    assert len(first_answer(completion)) < len(completion)
