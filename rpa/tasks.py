"""GRPO tasks: prompts with verifiable answers and their reward functions.

* ``synthetic-add``: "What is a + b? Answer:" with small integers, checked exactly. Offline,
  and learnable by a tiny model on CPU after a short supervised warm start
  (:func:`warm_start`), so the reward starts above zero.
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
from dataclasses import dataclass
from typing import Any, Callable

from rpa.errors import UserError, looks_like_hub_id

TASKS = ("synthetic-add", "gsm8k", "math")
DATA_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""``datasets`` builder names that read local ``data_files``."""


class TaskError(UserError):
    """A task that cannot be built (unknown name, missing columns, empty data)."""


@dataclass(frozen=True)
class TaskSpec:
    name: str = "synthetic-add"
    path: str | None = None
    """``datasets.load_dataset`` path: hub id, local directory, or a builder name
    (``json``/``parquet``/``csv``) together with ``data_files``."""
    data_files: str | None = None
    subset: str | None = None
    split: str = "train"
    num_prompts: int = 256
    max_operand: int = 9
    """synthetic-add: operands are drawn from 0..max_operand."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise TaskError(f"unknown task {self.name!r}; valid: {', '.join(TASKS)}")
        if self.name != "synthetic-add" and not self.path:
            raise TaskError(f"task {self.name!r} needs path (hub id such as 'openai/gsm8k', a local directory, "
                            f"or 'json' with data_files)")
        if self.num_prompts < 1 or self.max_operand < 1:
            raise TaskError("num_prompts and max_operand must be >= 1")
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
            raise TaskError(f"path {self.path!r}: no such file or directory, and not a hub id of the form 'org/name'")


# ----------------------------------------------------------------------- synthetic


def synthetic_add_rows(n: int, max_operand: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"What is {a} + {b}? Answer:", "answer": str(a + b)})
    return rows


_FIRST_INT = re.compile(r"-?\d+")


def _text(completion) -> str:
    """A completion as TRL passes it: a string, or a conversation whose last message is the reply."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


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


def math_verify_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when ``math_verify.verify`` accepts the completion's answer against the gold one."""
    from math_verify import parse, verify

    out = []
    for completion, gold in zip(completions, answer):
        text = _text(completion)
        gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$")
        try:
            ok = bool(gold_parsed) and verify(gold_parsed, parse(text))
        except Exception as err:  # math-verify raises on malformed LaTeX; that completion is wrong
            print(f"[rpa tasks] math-verify could not check a completion: {err}", file=sys.stderr)
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


def _load_rows(spec: TaskSpec, question_key: str, answer_key: str) -> list[dict[str, Any]]:
    import datasets

    kwargs: dict[str, Any] = {"split": spec.split}
    if spec.data_files:
        kwargs["data_files"] = spec.data_files
    data = datasets.load_dataset(spec.path, spec.subset, **kwargs)
    missing = {question_key, answer_key} - set(data.column_names)
    if missing:
        raise TaskError(f"dataset {spec.path!r} lacks column(s) {sorted(missing)}; has {data.column_names}")
    if len(data) == 0:
        raise TaskError(f"dataset {spec.path!r} split {spec.split!r} is empty")
    data = data.shuffle(seed=spec.seed).select(range(min(spec.num_prompts, len(data))))
    return [{question_key: r[question_key], answer_key: r[answer_key]} for r in data]


def build_task(spec: TaskSpec) -> tuple[list[dict[str, str]], Callable]:
    """``(rows, reward_fn)``; each row has ``prompt`` and ``answer``."""
    if spec.name == "synthetic-add":
        return synthetic_add_rows(spec.num_prompts, spec.max_operand, spec.seed), exact_int_reward
    if spec.name == "gsm8k":
        rows = _load_rows(spec, "question", "answer")
        return [{"prompt": f"{r['question']}\nAnswer:", "answer": gsm8k_gold(r["answer"])} for r in rows], \
            math_verify_reward
    rows = _load_rows(spec, "problem", "solution")
    return [{"prompt": f"{r['problem']}\nAnswer:", "answer": r["solution"]} for r in rows], math_verify_reward
