"""Rewards on the real benchmark files: gold answers score 1 on every row, perturbed answers 0;
the pool cuts a hanging scorer and goes on. Gold answers are read with this file's own parsing."""

import itertools
import json
import random
import re

import pytest

from trustbatch.data.benchmarks import detect_format, load_benchmark
from trustbatch.rewards import RewardPool, get
from trustbatch.rewards.countdown import solve
from trustbatch.rewards.math_answer import extract_answer, extract_boxed


def _rows(shared_dir, name):
    return [json.loads(l) for l in (shared_dir / "data" / name / "test.jsonl").read_text().splitlines() if l.strip()]


def _gold(answer) -> str:
    if isinstance(answer, float) and answer == int(answer):
        return str(int(answer))
    return str(answer)


def _perturbed(gold: str, other: str) -> str:
    """gold + 1 when gold is a plain number, else another row's (textually different) answer."""
    try:
        return str(int(gold) + 1)
    except ValueError:
        pass
    try:
        return str(float(gold) + 1)
    except ValueError:
        return other


@pytest.mark.parametrize("bench", ["math500", "aime2024", "amc2023"])
def test_math_reward_gold_scores_one_and_perturbed_zero_on_every_row(shared_dir, bench):
    rows = _rows(shared_dir, bench)
    golds = [_gold(r["answer"]) for r in rows]
    math = get("math")
    wrong_gold, right_perturbed = [], []
    for i, g in enumerate(golds):
        # MATH-500 ships worked solutions ending in \boxed{...}: score the real text; else a boxed answer
        completion = rows[i].get("solution") if bench == "math500" else f"So the answer is $\\boxed{{{g}}}$."
        if math(completion, g) != 1.0:
            wrong_gold.append(g)
        others = [o for o in golds[i + 1:] + golds[:i] if o.replace(" ", "") != g.replace(" ", "")]
        p = _perturbed(g, others[0])
        if math(f"The answer is \\boxed{{{p}}}.", g) != 0.0:
            right_perturbed.append((g, p))
    assert not wrong_gold, f"{len(wrong_gold)}/{len(golds)} gold answers not accepted: {wrong_gold[:5]}"
    assert not right_perturbed, f"perturbed answers accepted: {right_perturbed[:5]}"


def test_gsm8k_reward_gold_scores_one_and_perturbed_zero_on_every_row(shared_dir):
    rows = _rows(shared_dir, "gsm8k")
    gsm8k, math = get("gsm8k"), get("math")
    bad = []
    for r in rows:
        gold = r["answer"].split("####")[-1].strip().replace(",", "")
        wrong = str(float(gold) + 1)
        checks = [
            (gsm8k(r["answer"], gold), 1.0),  # the dataset's own worked solution
            (gsm8k(f"reasoning... #### {gold}", r["answer"]), 1.0),  # reference given as a whole solution
            (gsm8k(f"#### {wrong}", gold), 0.0),
            (gsm8k(f"I think {gold}. #### {wrong}", gold), 0.0),  # the #### answer wins over earlier numbers
        ]
        if not gold.startswith("-"):  # the answer negated is not the gold, its sign before or after a $ ("-$5" was 5)
            checks += [(gsm8k(f"#### $-{gold}", gold), float(float(gold) == 0)),
                       (gsm8k(f"#### -${gold}", gold), float(float(gold) == 0)), (gsm8k(f"#### -${gold}", f"-{gold}"), 1.0)]
        if [a for a, _ in checks] != [b for _, b in checks]:
            bad.append((gold, [a for a, _ in checks]))
    assert not bad, bad[:5]
    # the math reward on GSM8K golds, on a fixed sample (math-verify is slower)
    for r in random.Random(0).sample(rows, 200):
        gold = r["answer"].split("####")[-1].strip().replace(",", "")
        assert math(f"\\boxed{{{gold}}}", gold) == 1.0
        assert math(f"\\boxed{{{int(float(gold)) + 1}}}", gold) == 0.0


def _brute_force(numbers, target):
    """Every expression over all the numbers (each once), checked with Python's own eval."""
    ops = "+-*/"
    for perm in itertools.permutations(numbers):
        a, b, c = perm
        for o1, o2 in itertools.product(ops, ops):
            for e in (f"({a} {o1} {b}) {o2} {c}", f"{a} {o1} ({b} {o2} {c})"):
                try:
                    if abs(eval(e) - target) < 1e-9:
                        return e
                except ZeroDivisionError:
                    pass
    return None


def test_countdown_reward_on_every_row(shared_dir):
    cd = get("countdown")
    rows = _rows(shared_dir, "countdown")
    solvable = 0
    for r in rows:
        nums = [int(x) for x in r["input"].split(",")]
        target = int(r["output"])
        ref = json.dumps({"numbers": nums, "target": target})
        mine = _brute_force(nums, target)
        lib = solve(nums, target)
        assert (mine is None) == (lib is None), (nums, target)
        if lib is not None:  # the library's solution is checked independently: numbers and value
            assert sorted(int(x) for x in re.findall(r"\d+", lib)) == sorted(nums)
            assert abs(eval(lib) - target) < 1e-9
        if mine is None:
            continue
        solvable += 1
        assert cd(f"<think>...</think> <answer> {mine} </answer>", ref) == 1.0
        assert cd(f"<answer>{mine} = {target}</answer>", ref) == 1.0
        assert cd(f"<answer>{mine} + 1</answer>", json.dumps({"numbers": nums + [1], "target": target})) == 0.0
        assert cd(f"<answer>{mine}</answer>", json.dumps({"numbers": nums, "target": target + 1})) == 0.0
        twice = [nums[0], nums[0], nums[1]]  # allowed only if the row itself holds these numbers
        allowed = all(twice.count(x) <= nums.count(x) for x in twice)
        assert cd(f"<answer>{nums[0]} + {nums[0]} + {nums[1]}</answer>",
                  json.dumps({"numbers": nums, "target": sum(twice)})) == (1.0 if allowed else 0.0)
    assert solvable >= 0.9 * len(rows)


def test_countdown_at_most_once_and_safety():
    cd = get("countdown")
    ref = json.dumps({"numbers": [3, 5, 7], "target": 8})
    assert cd("<answer>3 + 5</answer>", ref) == 1.0  # at most once: 7 unused is fine
    assert cd("<answer>3 + 5 + 3 - 3</answer>", ref) == 0.0  # 3 used three times
    assert cd("<answer>__import__('os')</answer>", ref) == 0.0
    assert cd("<answer>8</answer>", ref) == 0.0  # 8 is not a given number
    assert cd("<answer>7 / (5 - 5) + 8</answer>", ref) == 0.0
    assert cd("", ref) == 0.0


def test_countdown_rows_with_negative_numbers():
    """The data side reads ``-3`` in a row's numbers and solve() writes it; the scorer counted the digits alone, so
    the -3 of a correct answer (its own demonstration too) was a 3 that is not given: 0. By hand: -3 + 5 + 7 = 9."""
    from trustbatch.data.benchmarks import to_example

    cd = get("countdown")
    ex = to_example({"input": "-3,5,7", "output": "9"}, "countdown")
    assert cd(ex.answer, ex.reference) == 1.0
    assert cd("<answer>-3 + 5 + 7</answer>", ex.reference) == 1.0
    assert cd("<answer>5 + 7 - 3</answer>", ex.reference) == 0.0  # 3 is not given, -3 is
    assert cd("<answer>7 - (-3)</answer>", json.dumps({"numbers": [-3, 5, 7], "target": 10})) == 1.0
    assert cd("<answer>-3 + -3 + 15</answer>", json.dumps({"numbers": [-3, 15], "target": 9})) == 0.0  # twice
    # a minus before a given positive number is that number, as before
    assert cd("<answer>-3 + 12</answer>", json.dumps({"numbers": [3, 12], "target": 9})) == 1.0


def test_boxed_extraction():
    assert extract_boxed(r"so $\boxed{\frac{1}{2}}$ and") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} then \boxed{x^{2}}") == "x^{2}"
    assert extract_boxed(r"cut off \boxed{\frac{1}{") is None
    # \boxed 5: the one token after it, never a brace further on
    assert extract_boxed("The answer is $\\boxed 5$, since $x^{2} = 25$.") == "5"
    assert extract_boxed("The answer is $\\boxed 5$.\n\\end{document}") == "5"
    assert extract_answer(r"so $d = \boxed{\textbf{(073)}}.$") == "$073$"
    assert extract_answer(r"cut off \boxed{\frac{1}{") is None  # an unfinished answer, not the digits before it
    assert get("math")("The answer is 0.5", r"\frac{1}{2}") == 1.0  # no box: math-verify's reading, symbolic


def test_math_reward_without_a_box_reads_the_answer_as_math_verify_does(shared_dir):
    """Without a box the reward is math-verify's own ``parse`` + ``verify`` of the completion (TRL's and verl's
    reward), never the text's last digits: on MATH-500, each row's gold written as a model writes an unboxed final
    answer scores 1, and another row's gold scores as math-verify scores it."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    math = get("math")
    golds = [_gold(r["answer"]) for r in _rows(shared_dir, "math500")]
    assert [g for g in golds if math(f"The final answer is ${g}$.", g) != 1.0] == []
    differ = []
    for i, g in enumerate(golds[:120]):
        other = golds[(i + 7) % len(golds)]
        said = f"The final answer is ${other}$."
        ref = float(verify(parse(f"${g}$", extraction_config=cfg), parse(said, extraction_config=cfg)))
        if math(said, g) != ref:
            differ.append((g, other))
    assert differ == []
    # the last digits of the text would score these 1 (3 of 14/3, 2 of sqrt 2, 2 of a cut-off box)
    assert math("The final answer is $\\frac{14}{3}$.", "3") == 0.0
    assert math("The answer is $\\sqrt{2}$.", "2") == 0.0
    assert math("So the answer is \\boxed{\\frac{3}{2", "2") == 0.0
    assert math("The final answer is $\\frac{14}{3}$.", "\\frac{14}{3}") == 1.0
    # MATH's money (\$18, which math-verify's patterns skip) and a box echoed empty from an instruction still read
    assert math("In total, Tom spends \\$42.50.", "42.50") == math("The answer is \\$18.90.", "\\$18.90") == 1.0
    assert math("I will put the final answer within \\boxed{}. So the answer is 5.", "5") == 1.0


def test_unicode_minus_roots_and_fractions_are_not_read_as_another_number():
    """math-verify reads nothing in ``x = −3``, ``√2`` or ``π/4`` (its own ``parse`` gives [], asserted below), so
    the reward's last-number fallback decides: it took ``3``, ``2`` and ``4`` and rewarded a wrong answer. By hand:
    −3 is minus three; √2 and π/4 are not 2 or 4. GSM8K's ``#### −5`` is minus five (verl's strict regex reads no
    answer there at all)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    math, gsm8k = get("math"), get("gsm8k")
    for text in ("So x = −3.", "The answer is √2", "The angle is π/4"):
        assert parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()]) == []
    assert math("So x = −3.", "3") == 0.0 and math("So x = −3.", "-3") == 1.0
    assert math("The answer is √2", "2") == 0.0
    assert math("The angle is π/4", "4") == 0.0
    assert math("The answer is 2^3", "3") == 0.0
    assert math("I count 12 apples.", "12") == 1.0  # a number followed by a word is still the answer
    assert gsm8k("She lost 5 dollars.\n#### −5", "5") == 0.0
    assert gsm8k("#### −5", "-5") == 1.0 and gsm8k("#### \uff0d5", "-5") == 1.0
    assert gsm8k("so it is √9", "9") == 0.0
    # a slash after the number is a rate, read as lm-evaluation-harness's flexible match reads it: 15, 3, 60
    for text, gold in (("so she earns $15/hour.", "15"), ("Each pound costs $3/lb", "3"), ("his speed is 60/hr", "60")):
        assert gsm8k(text, gold) == 1.0, text
    assert gsm8k("so the area is 3/π", "3") == 0.0 and gsm8k("so the area is 3/\\pi", "3") == 0.0  # a numerator


def test_a_small_float_gold_is_written_as_the_decimal_it_is(tmp_path):
    """A JSON number 0.00001 as ``str`` is ``1e-05``, which math-verify reads as ``1·e − 5`` (Euler's e): a correct
    ``0.00001`` scored 0 and ``e-5`` scored 1. Through the loader (plain prompt/answer rows and MATH-format rows);
    the reference is math-verify on the gold written by hand."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    from trustbatch.rewards.math_answer import gold_text

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    assert gold_text(1.5e20) == "150000000000000000000" and gold_text(0.25) == "0.25" and gold_text(27.0) == "27"
    math = get("math")
    for name, row, by_hand, bad in [("plain.jsonl", {"prompt": "p", "answer": 0.00001}, "0.00001", "e-5"),
                                    ("math.jsonl", {"problem": "q", "answer": 2.5e-06}, "0.0000025", "2.5e-6")]:
        (tmp_path / name).write_text(json.dumps(row) + "\n")
        [ex] = load_benchmark(str(tmp_path / name)).examples
        for said in (by_hand, bad):
            ref = verify(parse(f"${by_hand}$", extraction_config=cfg), parse(f"$\\boxed{{{said}}}$", extraction_config=cfg))
            assert math(f"The answer is $\\boxed{{{said}}}$.", ex.reference) == float(ref) == float(said == by_hand)


def test_countdown_exact_is_the_every_number_once_rule(shared_dir):
    """``countdown`` (at most once, issue 5's rule) rewards ``<answer> 43 </answer>`` for the numbers 90, 43, 90 and
    the target 43; TinyZero's and d1's rule (every number exactly once, ``countdown_exact``) does not. Counted by
    hand over the shared file: the rows whose target is one of their numbers."""
    exact, loose = get("countdown_exact"), get("countdown")
    rows = _rows(shared_dir, "countdown")
    echoed = 0
    for r in rows:
        nums, target = [int(x) for x in r["input"].split(",")], int(r["output"])
        ref = json.dumps({"numbers": nums, "target": target})
        if target in nums:
            echoed += 1
            assert loose(f"<answer> {target} </answer>", ref) == 1.0
            assert exact(f"<answer> {target} </answer>", ref) == 0.0
        mine = _brute_force(nums, target)
        if mine is not None:  # an expression with every number once scores 1 under both
            assert exact(f"<answer>{mine}</answer>", ref) == loose(f"<answer>{mine}</answer>", ref) == 1.0
    assert echoed == sum(int(r["output"]) in [int(x) for x in r["input"].split(",")] for r in rows) > 0
    assert exact("<answer>3 + 5</answer>", json.dumps({"numbers": [3, 5, 7], "target": 8})) == 0.0


def test_pool_cuts_hang_counts_errors_and_goes_on():
    items = ["ok", "hang", "ok", "die", "raise", "nan", "ok", "no"]
    refs = ["ok"] * len(items)
    with RewardPool("scorers_for_tests:misbehave", workers=2, timeout_s=0.5) as pool:
        res = pool.score(items, refs)
        assert res.rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert res.timeouts == 1
        assert res.errors == 3  # died, raised, NaN
        again = pool.score(["ok"] * 6, ["ok"] * 6)  # the replaced workers still score
        assert again.rewards == [1.0] * 6 and again.errors == again.timeouts == 0


def test_pool_in_process_matches_pooled_parsing():
    comps = ["\\boxed{3}", "#### 4", "the answer is 5", "\\boxed{\\frac{6}{2}}"]
    refs = ["3", "4", "5", "3"]
    with RewardPool("math", workers=0) as a, RewardPool("math", workers=2) as b:
        assert a.score(comps, refs).rewards == b.score(comps, refs).rewards == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("bench,fmt,rows", [("gsm8k", "gsm8k", 1319), ("math500", "math", 500), ("aime2024", "math", 30),
                                            ("amc2023", "math", 40), ("countdown", "countdown", 256)])
def test_loaders_detect_format_and_keep_every_row(shared_dir, bench, fmt, rows):
    b = load_benchmark(bench, data_dir=str(shared_dir / "data"))
    assert b.format == fmt and len(b.examples) == rows
    raw = _rows(shared_dir, bench)
    assert detect_format(raw[0]) == fmt
    e = b.examples[0]
    text = raw[0].get("question") or raw[0].get("problem")
    if text:
        assert e.prompt.startswith(text)
    # the reference each loader builds is scored 1 by the format's reward for the demonstration
    # it also builds (worked solution, boxed answer, or a solved Countdown expression)
    scorer = get(b.reward)
    ok = sum(scorer(x.answer, x.reference) for x in b.examples[:30])
    assert ok == min(30, rows) or bench == "countdown" and ok >= 27


def test_generic_jsonl_fields_and_bad_files(tmp_path, monkeypatch):
    from trustbatch.errors import UserError

    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"q": "What is 2+2?", "a": 4}) + "\n" + json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    b = load_benchmark(str(f), prompt_field="q", answer_field="a")
    assert b.format == "jsonl" and b.reward == "math"
    assert [(e.prompt, e.reference) for e in b.examples] == [("What is 2+2?", "4"), ("1+1?", "2")]
    with pytest.raises(UserError, match="line 1: the row has no prompt field .question."):
        load_benchmark(str(f), prompt_field="question", answer_field="a")
    with pytest.raises(UserError, match="cannot tell the format"):
        load_benchmark(str(f))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        load_benchmark(str(bad))
    monkeypatch.delenv("TRUSTBATCH_DATA", raising=False)
    with pytest.raises(UserError, match="needs its data: set data.dir=DIR .trustbatch eval: --data-dir DIR."):
        load_benchmark("gsm8k")


def test_prompt_answer_rows_need_no_fields_and_the_refusal_names_the_keys(tmp_path):
    """Rows with ``prompt`` and ``answer`` (TRL's prompt column) read as plain rows; rows of no known format are
    refused naming the keys that exist (data.prompt_field, --prompt-field), not a ``format=jsonl`` no command takes."""
    from trustbatch.errors import UserError

    f = tmp_path / "plain.jsonl"
    f.write_text(json.dumps({"prompt": "What is 2+2?", "answer": 4, "extra": "x"}) + "\n")
    b = load_benchmark(str(f))
    assert b.format == "jsonl" and b.reward == "math"
    assert [(e.prompt, e.reference, e.columns["extra"]) for e in b.examples] == [("What is 2+2?", "4", "x")]
    g = tmp_path / "other.jsonl"  # no answer field: TRL's prompt-only rows (its reward functions read "solution")
    g.write_text(json.dumps({"prompt": "2+2?", "solution": "4"}) + "\n")
    b = load_benchmark(str(g))
    assert (b.format, b.reward, b.examples[0].reference, b.examples[0].columns["solution"]) == ("prompts", "", "", "4")
    g.write_text(json.dumps({"question": "2+2?", "solution": "4"}) + "\n")
    with pytest.raises(UserError) as e:
        load_benchmark(str(g))
    assert "data.prompt_field=" in str(e.value) and "--prompt-field" in str(e.value)
    assert "format=jsonl" not in str(e.value)
    h = tmp_path / "chat.jsonl"  # TRL's conversational rows: the prompt's messages are kept (test_conversational)
    h.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n")
    assert load_benchmark(str(h)).examples[0].prompt.messages == ({"role": "user", "content": "2+2?"},)
    h.write_text(json.dumps({"prompt": "2+2?", "answer": [{"role": "assistant", "content": "4"}]}) + "\n")
    with pytest.raises(UserError, match="line 1: the answer field 'answer' is a list of chat messages .TRL's "
                                        "conversational format., which only a prompt may be"):
        load_benchmark(str(h))


@pytest.mark.parametrize("task", ["arc_agi", "rearc"])
def test_reasoning_gym_tasks_score_their_own_answer_as_reasoning_gym_does(task):
    """A task's reference keeps its entry's tuples: reasoning-gym's ``score_answer`` compares arc_agi's and rearc's
    answer board with ``==`` against a tuple of tuples, which a JSON list never equals (the gold scored 0.05)."""
    from trustbatch.data.tasks import load_task
    from trustbatch.rewards.scorers import import_reasoning_gym, score_one

    rg, _ = import_reasoning_gym()
    split = load_task(task, train_size=2, heldout_size=1, seed=0)
    entries = list(rg.create_dataset(task, size=6, seed=0))  # load_task's pool: the same generator and seed
    scorer = get(split.reward)
    for ex in split.heldout + split.train:
        entry = next(e for e in entries if e["question"] == ex.prompt)
        assert score_one(scorer, ex.answer, ex.reference)[0] == rg.get_score_answer_fn(task)(ex.answer, entry) == 1.0
