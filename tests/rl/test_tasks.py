"""Rewards checked by code, for each task's answer style."""

import pytest

from vllm_specrl.rl.tasks import make_tasks, reward


def test_tasks_are_fixed_by_seed_and_step():
    assert make_tasks(3, 4, seed=0) == make_tasks(3, 4, seed=0)
    assert make_tasks(3, 4, seed=0) != make_tasks(4, 4, seed=0)
    prompt, answer = make_tasks(0, 1, seed=0, task="explain")[0]
    a, b = [int(x) for x in prompt.split("?")[0].removeprefix("What is ").split(" + ")]
    assert answer == a + b and "Explain" in prompt


@pytest.mark.parametrize("text,task,want", [
    ("7", "arithmetic", 1.0), ("3 + 4 is 7.", "arithmetic", 1.0), ("The answer is 8", "arithmetic", 0.0),
    ("3 + 4: add 4 to 3 and you get 7.", "explain", 1.0),
    ("7 is what you get from 3 + 4", "explain", 0.0),  # the conclusion (last number) is 4
    ("I cannot say.", "explain", 0.0),
])
def test_reward(text, task, want):
    assert reward(text, 7, task) == want


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="explain"):
        make_tasks(0, 1, 0, task="chess")


def test_a_dataset_comes_back_every_epoch():
    """8 tasks, 4 per step: steps 0 and 2 (and 1 and 3) draw the same prompts, 0 and 1 do not."""
    steps = [make_tasks(step, 4, seed=0, task="explain", dataset_size=8) for step in range(4)]
    assert steps[0] == steps[2] and steps[1] == steps[3]
    assert not set(steps[0]) & set(steps[1])
    assert set(steps[0]) | set(steps[1]) == set(make_tasks(0, 8, seed=0, task="explain"))


def test_a_draft_warm_start_sees_every_prompt_of_the_task_once():
    """The explain draft trains on the RL task's own prompts: distinct, all 81 of them at most, and
    covering every prompt a demo step can draw (a held-out split by prompt needs no duplicates)."""
    from vllm_specrl.trainer.offline import default_prompts

    prompts = default_prompts(200, seed=0, task="explain")
    assert len(prompts) == len(set(prompts)) == 81
    assert {p for step in range(20) for p, _ in make_tasks(step, 4, seed=0, task="explain")} <= set(prompts)
    assert default_prompts(10, seed=1, task="explain") != default_prompts(10, seed=0, task="explain")


@pytest.mark.parametrize("text,task,answer,want", [
    ("3 + 4 = 7.", "concise", 7, 1.0),
    ("3 + 4 = 8.", "concise", 7, 0.5),  # short, wrong
    (" ".join(["word"] * 30) + " so 7", "concise", 7, 0.5),  # right, over the word budget
    (" ".join(["word"] * 30) + " so 8", "concise", 7, 0.0),
    ("9 - 3 = 6", "concise-minus", 6, 1.0),
    ("9-3=6", "concise-minus", 6, 1.0),
])
def test_concise_reward_pays_half_for_the_conclusion_and_half_for_brevity(text, task, answer, want):
    assert reward(text, answer, task) == want


def test_concise_steps_never_draw_a_held_out_prompt():
    from vllm_specrl.rl.tasks import held_out_prompts

    held = set(held_out_prompts("concise"))
    drawn = {p for step in range(200) for p, _ in make_tasks(step, 8, seed=0, task="concise")}
    assert len(held) == 8 and not held & drawn
    assert len(drawn) == 81 - 8  # every other pair is drawn


def test_concise_minus_asks_a_minus_b_with_a_non_negative_answer():
    for prompt, answer in make_tasks(0, 16, seed=1, task="concise-minus"):
        a, b = [int(x) for x in prompt.split("?")[0].removeprefix("What is ").split(" - ")]
        assert answer == a - b >= 0


def test_a_schedule_switches_task_and_reward_at_its_step():
    from vllm_specrl.rl.tasks import TaskSchedule

    schedule = TaskSchedule("concise", 4, seed=0, switch_task="concise-minus", switch_at=3)
    assert [schedule.task_at(i) for i in range(5)] == ["concise"] * 3 + ["concise-minus"] * 2
    before, after = schedule.tasks(2), schedule.tasks(3)
    assert all(" + " in p for p, _ in before) and all(" - " in p for p, _ in after)
    prompt, answer = after[0]
    assert schedule.score(f"so {answer[1]}", answer) == 1.0 and schedule.score("so 99", answer) == 0.5
    with pytest.raises(ValueError, match="both"):
        TaskSchedule("concise", 4, 0, switch_task="concise-minus")


def test_answer_style_counts_words_equations_and_the_phrase():
    from vllm_specrl.rl.tasks import style_summary

    got = style_summary(["3 + 4 = 7. The answer is 7.", "Seven."])
    assert got == {"words": 5.0, "equation": 0.5, "answer_is": 0.5}  # 9 words and 1
