"""The prompts a probe or a diagnosis samples from: the built-in default, or a prompts file.

A prompt is a string, or a conversation (a list of ``{"role", "content"}`` messages) that
:func:`render_prompt` turns into text with the model's own chat template (the assistant's turn
opened), as TRL does for a conversational dataset. A prompts file (``rpa prompts`` writes one
from a task) is JSON lines with a ``prompt`` key per line (other keys, e.g. ``answer``, are kept
for the reader and ignored here), or plain text with one prompt per line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rpa.core.errors import InputError


OPERANDS = 100
"""The built-in prompts' operands are ``0 .. OPERANDS - 1``."""

DEFAULT_PROMPTS_DISTINCT = OPERANDS ** 2 + 10 ** 2 + 2
"""How many distinct prompts :func:`default_prompts` can give: a sum of two operands (``OPERANDS**2``),
a sort of three digits the operands' last digits fix (``10**2``), and two fixed texts. A probe or a
diagnosis asking for more built-in prompts than this is refused: more would only repeat them (and
a count of 10**11 ran until memory was gone); more samples come from ``--samples`` or a prompts file."""


def default_prompts(n: int, seed: int) -> list[str]:
    """The probe's built-in prompts (short arithmetic and counting text, for the tiny models)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, OPERANDS - 1), rng.randint(0, OPERANDS - 1)
        out.append(rng.choice([f"What is {a} + {b}? Answer:", f"sort {a % 10} {b % 10} {(a + b) % 10} ->",
                               "the number of words in this list is", "count up: 1 2 3"]))
    return out


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def read_prompts(path: str | Path) -> list[Any]:
    """The prompts of a prompts file (see the module doc), or :class:`InputError` naming the line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompts file {path}: no such file" + (" (a directory)" if path.is_dir() else ""))
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise InputError(f"prompts file {path}: not a text file") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise InputError(f"prompts file {path}: no prompts (empty file)")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]  # plain text, one prompt per line
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"prompts file {path}:{n}: not a JSON line ({err.msg})") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not (isinstance(prompt, str) and prompt) and not _is_conversation(prompt):
            raise InputError(f"prompts file {path}:{n}: needs a 'prompt' that is a non-empty string or a list of "
                             f"{{role, content}} messages")
        prompts.append(prompt)
    return prompts


def render_prompt(prompt: Any, tokenizer) -> str:
    """A prompt as the text both engines see: a string as it is, a conversation through the
    tokenizer's chat template with the assistant's turn opened (refused without a template)."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("a chat-format prompt needs a tokenizer with a chat template; this model has none "
                         "(use plain-text prompts)")
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def render_rows(rows: list[dict[str, Any]], tokenizer) -> list[dict[str, Any]]:
    """Task rows with every prompt rendered (:func:`render_prompt`)."""
    return [{**r, "prompt": render_prompt(r["prompt"], tokenizer)} for r in rows]


def probe_prompts(count: int, seed: int, prompts_file: str | Path | None, tokenizer) -> list[str]:
    """``count`` rendered prompts: the first ``count`` of ``prompts_file`` (refused when it has
    fewer), else :func:`default_prompts`."""
    if prompts_file is None:
        return default_prompts(count, seed)
    prompts = read_prompts(prompts_file)
    if len(prompts) < count:
        raise InputError(f"prompts file {prompts_file}: {len(prompts)} prompts, the probe asks for {count}")
    return [render_prompt(p, tokenizer) for p in prompts[:count]]
