"""The one base class of every error that is the user's input, not a bug.

Each module raises its own subclass (a bad region name, config key, model, file, ...)
with a one-line message naming the input; the CLI prints that line and exits 2 for any
of them, and lets everything else through as a traceback.
"""

from __future__ import annotations

import re

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face hub id, ``org/name``."""


class UserError(ValueError):
    """Bad input: the message says which and why, in one line."""


class InputError(UserError):
    """A model, file or directory given on the command line or in a config that cannot be used."""


HUB_ID_FORM = "a hub id of the form 'org/name' whose org is not a local directory"
"""What :func:`looks_like_hub_id` takes, for messages."""


def looks_like_hub_id(spec: str) -> bool:
    """``spec``, a path that is not there, reads as a hub id: ``org/name``, and ``org`` not a local
    directory (``models/mine`` beside a ``models/`` directory is a local path that is missing, not a
    hub id to ask the hub for)."""
    from pathlib import Path

    return bool(HUB_ID.match(spec)) and not spec.startswith((".", "/", "~")) and not Path(spec).parent.is_dir()
