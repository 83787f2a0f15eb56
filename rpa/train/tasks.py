"""GRPO tasks: prompts with verifiable answers, their reward functions and accuracy.

* ``synthetic-add``: a + b with integers up to ``max_operand``, checked exactly (the first
  integer of the completion). Offline. Three prompt formats (``prompt_format``): ``plain``
  ("What is a + b? Answer:"), learnable by a tiny model on CPU after a short supervised warm
  start (:func:`warm_start`); ``fewshot`` ("Question: a + b" / "Answer:" after
  ``fewshot_examples`` solved ones), the format in which a small pretrained LM answers 2-digit
  sums at T = 1 often enough, and not always, for GRPO's groups to differ; ``chat`` (one user
  message, rendered with the model's chat template where the run or probe has a tokenizer).
* ``count``: "count from a by k:" -> the next ``length`` numbers mod 100, written out (two tokens
  each with the tiny tokenizer: ~64 completion tokens at length 32), so per-token mismatch
  can accumulate over a long completion. Reward: the share of the ``length`` positions right;
  accuracy: all of them right.
* ``walk``: "walk from a:" -> ``length`` numbers, each one step of +-1, +-2 or +-3 (mod 100)
  from the one before (the first from a). Any such walk is right, so every position has six
  equally rewarded continuations: the best policy need not become deterministic, and the
  supervised warm start (on random walks, several per start) spreads it over them. This keeps
  the policy's entropy up (~0.9 nats per token at the start with the tiny tokenizer's two
  tokens per number), as real RL policies are, where ``count`` (one right answer) makes it
  near-deterministic -- and mismatch tracks entropy. Reward: the share of the ``length``
  positions that are a valid step; accuracy: all of them valid and exactly ``length`` numbers.
* ``eos-sanity``: the check TRL's maintainers used for the trainer-generator mismatch: the
  reward falls with the completion's length (1 / tokens), so the best policy ends at once
  and any correct pipeline converges within a handful of steps. Accuracy: ending at once.
* ``gsm8k`` / ``math``: loaded with ``datasets.load_dataset`` from a hub id or a local
  path / data files (GSM8K: ``question`` + ``answer`` ending in ``#### N``; MATH:
  ``problem`` + ``solution`` with ``\\boxed{...}``), answers checked with ``math-verify``.

A reward function has TRL's signature ``f(prompts, completions, answer, **kwargs) ->
list[float]`` and returns 1.0 for a correct answer, else 0.0.
"""

from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from rpa.core.errors import HUB_ID_FORM, UserError, looks_like_hub_id
from rpa.measure.prompts import render_prompt, render_rows  # noqa: F401 - a task's rows as the engines see them

TASKS = ("synthetic-add", "count", "walk", "eos-sanity", "gsm8k", "math")
SYNTHETIC = ("synthetic-add", "count", "walk", "eos-sanity")
PROMPT_FORMATS = ("plain", "fewshot", "chat")
"""``synthetic-add``'s prompt formats (see the module doc)."""
DATA_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""``datasets`` builder names that read local ``data_files``."""


class TaskError(UserError):
    """A task that cannot be built (unknown name, missing columns, empty data)."""


@dataclass(frozen=True)
class TaskSpec:
    name: str = field(default="synthetic-add", metadata={
        "help": "the task (rpa.train.tasks: synthetic-add, count, walk or a dataset)"})
    path: str | None = field(default=None, metadata={
        "help": "``datasets.load_dataset`` path: hub id, local directory, or a builder name "
                "(``json``/``parquet``/``csv``) together with ``data_files``."})
    data_files: str | None = field(default=None, metadata={
        "help": "files of a json/parquet/csv builder (datasets' data_files)"})
    subset: str | None = field(default=None, metadata={"help": "dataset configuration name (datasets' name)"})
    split: str = field(default="train", metadata={"help": "training split of a dataset"})
    num_prompts: int = field(default=256, metadata={"help": "training prompts drawn"})
    max_operand: int = field(default=9, metadata={"help": "synthetic-add: operands are drawn from 0..max_operand."})
    prompt_format: str = field(default="plain", metadata={
        "help": "synthetic-add: ``plain``, ``fewshot`` or ``chat`` (:data:`PROMPT_FORMATS`)."})
    fewshot_examples: int = field(default=3, metadata={
        "help": "synthetic-add with ``prompt_format: fewshot``: solved examples before the question."})
    length: int = field(default=32, metadata={"help": "count, walk: numbers per answer."})
    eval_prompts: int = field(default=0, metadata={
        "help": "Held-out prompts scored every ``eval_every`` steps of a run (0: no evaluation); synthetic tasks draw"
                " them with another seed, datasets take them from ``eval_split``."})
    eval_split: str = field(default="test", metadata={"help": "held-out split of a dataset"})
    seed: int = field(default=0, metadata={"help": "seed of the synthetic prompts (the held-out ones use another)"})

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise TaskError(f"unknown task {self.name!r}; valid: {', '.join(TASKS)}")
        if self.name not in SYNTHETIC and not self.path:
            raise TaskError(f"task {self.name!r} needs path (hub id such as 'openai/gsm8k', a local directory, "
                            f"or 'json' with data_files)")
        if self.num_prompts < 1 or self.max_operand < 1 or self.length < 1 or self.eval_prompts < 0:
            raise TaskError("num_prompts, max_operand and length must be >= 1, eval_prompts >= 0")
        if self.prompt_format not in PROMPT_FORMATS:
            raise TaskError(f"prompt_format {self.prompt_format!r} is not one of {', '.join(PROMPT_FORMATS)}")
        if self.prompt_format != "plain" and self.name != "synthetic-add":
            raise TaskError(f"prompt_format {self.prompt_format!r}: only synthetic-add has prompt formats")
        if self.fewshot_examples < 1:
            raise TaskError(f"fewshot_examples must be >= 1, got {self.fewshot_examples}")
        if self.path:
            self._check_path()

    def _check_path(self) -> None:
        """Local paths and data files must exist now (a hub id is resolved when loading)."""
        import glob
        from pathlib import Path

        if self.path in DATA_BUILDERS:
            if not self.data_files:
                raise TaskError(f"path {self.path!r} is a datasets builder: it needs data_files")
            files = [self.data_files] if isinstance(self.data_files, str) else list(self.data_files)
            missing = [f for f in files if not glob.glob(str(Path(f).expanduser()))]
            if missing:
                raise TaskError(f"data_files: no such file(s): {', '.join(map(str, missing))}")
        elif not Path(self.path).expanduser().exists() and not looks_like_hub_id(self.path):
            raise TaskError(f"path {self.path!r}: no such file or directory, and not {HUB_ID_FORM}")


# ----------------------------------------------------------------------- synthetic


def synthetic_add_rows(n: int, max_operand: int, seed: int, prompt_format: str = "plain",
                       fewshot_examples: int = 3) -> list[dict[str, Any]]:
    """``n`` sums a + b (operands 0..``max_operand``) in ``prompt_format``: a string prompt, or for
    ``chat`` a one-message conversation (``[{"role": "user", "content": ...}]``) that
    :func:`rpa.measure.prompts.render_prompt` turns into text with the model's chat template."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if prompt_format == "fewshot":
            shots = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(fewshot_examples)]
            solved = "".join(f"Question: {x} + {y}\nAnswer: {x + y}\n\n" for x, y in shots)
            prompt: Any = f"{solved}Question: {a} + {b}\nAnswer:"
        elif prompt_format == "chat":
            prompt = [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]
        else:
            prompt = f"What is {a} + {b}? Answer:"
        rows.append({"prompt": prompt, "answer": str(a + b)})
    return rows


_FIRST_INT = re.compile(r"-?\d+")


def _text(completion) -> str:
    """A completion as TRL passes it: a string, or a conversation whose last message is the reply."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


COUNT_STEPS = (1, 2, 3)
COUNT_HELD_OUT = 0.2
"""Share of the (start, step) pairs of ``count`` kept for evaluation only."""


def _split(items: list, held_out_share: float, seed: int, held_out: bool) -> tuple[list, random.Random]:
    """The training or held-out part of ``items`` (one shuffle by ``seed``; the first
    ``held_out_share`` is held out) and the generator that draws rows from it."""
    items = list(items)
    random.Random(seed).shuffle(items)
    cut = int(len(items) * held_out_share)
    return (items[:cut] if held_out else items[cut:]), random.Random(seed + (1 if held_out else 0))


def count_rows(n: int, length: int, seed: int, held_out: bool = False) -> list[dict[str, str]]:
    """``n`` prompts "count from a by k:" -> the next ``length`` numbers a + k, a + 2k, ... mod
    100. The 300 (a, k) pairs are split once (by ``seed``) into training and held-out pairs."""
    pool, rng = _split([(a, k) for a in range(100) for k in COUNT_STEPS], COUNT_HELD_OUT, seed, held_out)
    rows = []
    for _ in range(n):
        start, step = rng.choice(pool)
        rows.append({"prompt": f"count from {start} by {step}:",
                     "answer": " ".join(str((start + step * i) % 100) for i in range(1, length + 1))})
    return rows


_INTS = re.compile(r"-?\d+")

WALK_STEPS = (1, 2, 3)
"""``walk``: the step sizes allowed up or down (mod 100)."""
WALK_HELD_OUT = 0.2
"""Share of the 100 start numbers of ``walk`` kept for evaluation only."""


def walk_rows(n: int, length: int, seed: int, held_out: bool = False) -> list[dict[str, str]]:
    """``n`` prompts "walk from a:" with one random valid walk each as the answer (starts are
    split once, by ``seed``, into training and held-out starts; a start recurs with other walks)."""
    pool, rng = _split(list(range(100)), WALK_HELD_OUT, seed, held_out)
    rows = []
    for _ in range(n):
        x = start = rng.choice(pool)
        walk = []
        for _ in range(length):
            x = (x + rng.choice(WALK_STEPS) * rng.choice((1, -1))) % 100
            walk.append(str(x))
        rows.append({"prompt": f"walk from {start}:", "answer": " ".join(walk)})
    return rows


def _walk_valid(prompt: str, completion) -> list[bool]:
    start = int(_INTS.findall(prompt)[-1])
    got = [int(x) for x in _INTS.findall(_text(completion))]
    valid, prev = [], start
    for x in got:
        valid.append(0 <= x < 100 and (x - prev) % 100 in {s % 100 for s in WALK_STEPS} | {-s % 100 for s in WALK_STEPS})
        prev = x
    return valid


def walk_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """Share of the ``length`` positions (the answer's) that are a valid step from the number
    before; numbers past ``length`` do not count."""
    out = []
    for prompt, completion, gold in zip(prompts, completions, answer):
        length = len(gold.split())
        out.append(sum(_walk_valid(_text(prompt), completion)[:length]) / length)
    return out


def walk_correct(completion, gold: str, completion_ids=None, prompt: str | None = None) -> bool:
    if prompt is None:
        raise ValueError("walk: correctness depends on the prompt's start number; pass prompt=")
    valid = _walk_valid(prompt, completion)
    return len(valid) == len(gold.split()) and all(valid)


def count_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """Share of the answer's positions where the completion has the right number."""
    out = []
    for completion, gold in zip(completions, answer):
        want, got = gold.split(), _INTS.findall(_text(completion))
        out.append(sum(a == b for a, b in zip(got, want)) / len(want))
    return out


def count_correct(completion, gold: str, completion_ids=None, prompt=None) -> bool:
    return _INTS.findall(_text(completion)) == gold.split()


def eos_sanity_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """1 / (completion tokens): 1.0 for a completion that ends at once."""
    return [1.0 / max(len(ids), 1) for ids in completion_ids]


def eos_sanity_correct(completion, gold: str, completion_ids=None, prompt=None) -> bool:
    return completion_ids is not None and len(completion_ids) <= 1


def exact_int_correct(completion, gold: str, completion_ids=None, prompt=None) -> bool:
    match = _FIRST_INT.search(_text(completion))
    return match is not None and match.group() == str(gold).strip()


def exact_int_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the first integer in the completion equals the answer."""
    out = []
    for completion, gold in zip(completions, answer):
        match = _FIRST_INT.search(_text(completion))
        out.append(1.0 if match is not None and match.group() == str(gold).strip() else 0.0)
    return out


# ----------------------------------------------------------------------- math


def gsm8k_gold(answer: str) -> str:
    """The final number of a GSM8K answer (after ``####``)."""
    if "####" not in answer:
        raise TaskError(f"GSM8K answer without '####': {answer[:80]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


_CONTINUATION = re.compile(r"\n\s*(Question|Problem)\s*:")
"""Where a base model, having answered, starts writing the next exercise of its pretraining data."""


def _closing_brace(text: str, start: int) -> int | None:
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def first_answer(text: str) -> str:
    """The completion up to its first answer: through the line of its first ``#### N`` (GSM8K's
    format), else through its first complete ``\\boxed{...}`` (MATH's), else up to where a new
    ``Question:``/``Problem:`` begins. math-verify takes the *last* answer it finds, so a base
    model that answers and then writes another exercise would otherwise be scored on that one."""
    cut = _CONTINUATION.search(text)
    head = text[:cut.start()] if cut else text
    marker = head.find("####")
    if marker >= 0:
        end = head.find("\n", marker)
        return head if end < 0 else head[:end]
    boxed = head.find("\\boxed{")
    if boxed >= 0:
        close = _closing_brace(head, boxed + len("\\boxed"))
        if close is not None:
            return head[:close + 1]
    return head


def math_verify_correct(completion, gold: str, completion_ids=None, prompt=None) -> bool:
    return math_verify_reward(None, [completion], [gold])[0] == 1.0


def math_verify_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when ``math_verify.verify`` accepts the completion's first answer (:func:`first_answer`)
    against the gold one."""
    from math_verify import parse, verify

    out = []
    for completion, gold in zip(completions, answer):
        text = first_answer(_text(completion))  # the answer given, not a later exercise's
        gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$")
        try:
            ok = bool(gold_parsed) and verify(gold_parsed, parse(text))
        except Exception as err:  # math-verify raises on malformed LaTeX; that completion is wrong
            print(f"[rpa tasks] math-verify could not check a completion: {err}", file=sys.stderr)
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


def _load_rows(spec: TaskSpec, question_key: str, answer_key: str, split: str | None = None,
               count: int | None = None) -> list[dict[str, Any]]:
    import datasets

    kwargs: dict[str, Any] = {"split": split or spec.split}
    if spec.data_files:
        kwargs["data_files"] = spec.data_files
    data = datasets.load_dataset(spec.path, spec.subset, **kwargs)
    missing = {question_key, answer_key} - set(data.column_names)
    if missing:
        raise TaskError(f"dataset {spec.path!r} lacks column(s) {sorted(missing)}; has {data.column_names}")
    if len(data) == 0:
        raise TaskError(f"dataset {spec.path!r} split {spec.split!r} is empty")
    data = data.shuffle(seed=spec.seed).select(range(min(count or spec.num_prompts, len(data))))
    return [{question_key: r[question_key], answer_key: r[answer_key]} for r in data]


@dataclass(frozen=True)
class Task:
    """Rows (``prompt``, ``answer``) to train on, held-out rows to evaluate on, TRL's reward
    function and a per-completion accuracy ``correct(completion, answer, completion_ids, prompt)``."""

    rows: list[dict[str, str]]
    eval_rows: list[dict[str, str]]
    reward: Callable
    correct: Callable


def build_task(spec: TaskSpec) -> Task:
    """The task ``spec`` names; ``eval_rows`` is empty unless ``spec.eval_prompts``."""
    held_out = spec.seed + 100_003  # another stream of the same generator: prompts not trained on
    if spec.name == "synthetic-add":
        fmt = (spec.prompt_format, spec.fewshot_examples)
        return Task(synthetic_add_rows(spec.num_prompts, spec.max_operand, spec.seed, *fmt),
                    synthetic_add_rows(spec.eval_prompts, spec.max_operand, held_out, *fmt), exact_int_reward,
                    exact_int_correct)
    if spec.name in ("count", "eos-sanity"):
        reward, correct = (count_reward, count_correct) if spec.name == "count" else \
            (eos_sanity_reward, eos_sanity_correct)
        return Task(count_rows(spec.num_prompts, spec.length, spec.seed),
                    count_rows(spec.eval_prompts, spec.length, spec.seed, held_out=True), reward, correct)
    if spec.name == "walk":
        return Task(walk_rows(spec.num_prompts, spec.length, spec.seed),
                    walk_rows(spec.eval_prompts, spec.length, spec.seed, held_out=True), walk_reward, walk_correct)
    if spec.name == "gsm8k":
        def gsm8k(rows):
            return [{"prompt": f"{r['question']}\nAnswer:", "answer": gsm8k_gold(r["answer"])} for r in rows]

        evals = _load_rows(spec, "question", "answer", spec.eval_split, spec.eval_prompts) if spec.eval_prompts else []
        return Task(gsm8k(_load_rows(spec, "question", "answer")), gsm8k(evals), math_verify_reward,
                    math_verify_correct)

    def math(rows):
        return [{"prompt": f"{r['problem']}\nAnswer:", "answer": r["solution"]} for r in rows]

    evals = _load_rows(spec, "problem", "solution", spec.eval_split, spec.eval_prompts) if spec.eval_prompts else []
    return Task(math(_load_rows(spec, "problem", "solution")), math(evals), math_verify_reward, math_verify_correct)
