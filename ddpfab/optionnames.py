"""How a message names one of the run's options: by the name :class:`ddpfab.api.Options` gives it
(``exit_guard``, ``sync=False``), unless the command line, which spells options as flags, has said
so (``--exit-guard``, ``--no-sync``). The planner, the checks and the launch write their messages
with :func:`option`; only the CLI knows its flags, and it sets the spelling for the command it runs
(:func:`spelled_by`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: Spells (field, value) for the reader; the value is :data:`NO_VALUE` when only the name is meant.
Speller = Callable[[str, Any], str]


class _NoValue:
    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()


def python_name(field: str, value: Any = NO_VALUE) -> str:
    """*field* as a library caller writes it: ``exit_guard``, or with a value ``exit_guard='off'``."""
    return field if value is NO_VALUE else f"{field}={value!r}"


_speller: Speller = python_name


def option(field: str, value: Any = NO_VALUE) -> str:
    """Option *field* (an :class:`ddpfab.api.Options` field or a command's keyword argument) as the
    reader of the message spells it, alone or with *value*: ``option("sync", False)`` is
    ``sync=False`` to a library caller and ``--no-sync`` to a command-line user."""
    return _speller(field, value)


@contextmanager
def spelled_by(speller: Speller) -> Iterator[None]:
    """Within: every :func:`option` is spelled by *speller*. Process-wide, not a context variable:
    the per-node threads that write messages must see it too; the CLI runs one command a process."""
    global _speller
    before, _speller = _speller, speller
    try:
        yield
    finally:
        _speller = before
