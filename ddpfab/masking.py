"""Which environment values are secret, and how they are masked: the one rule every printed and
recorded form follows (the dry run's lines and ``--json``, the manifest's plan, options and
argv, emitted scripts' READMEs, replay), for env values and for the assignments in setup lines
(``ddpfab_setup``: :func:`mask_setup_line`).

A value is masked **whole** when its key is secret:

- the key contains, anywhere, one of :data:`SECRET_PARTS` (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``,
  ``MYPASSWORD``, ``WANDB_API_KEY``, ``GOOGLE_APPLICATION_CREDENTIALS``);
- or one of its words (split at ``_``, trailing digits dropped) is one of :data:`SECRET_WORDS`
  (``DB_PASS``, ``MYSQL_PWD``, ``GITHUB_PAT``, ``AWS_ACCESS_KEY_ID``, ``COMET_KEY``, ``SENTRY_DSN``);
- or it is marked: ``--secret-env KEY`` (repeatable) or the inventory's ``ddpfab_secret_env`` list.

Any other value keeps its text except the credentials of a URL in it (``DATABASE_URL``,
``REDIS_URL``, a git remote): ``scheme://user:PASSWORD@host`` shows as ``scheme://user:***@host``
and ``scheme://TOKEN@host`` (no password: the user part is often the token) as
``scheme://***@host``. That is read from the value's URL structure, never by looking for a
known secret's text. Masking more than needed is harmless; less is a leak, so the rule errs wide.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
#: Anywhere in a key (case-insensitive): the key is secret.
SECRET_PARTS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "PRIVATE", "APIKEY",
                "API_KEY")
#: A whole word of a key (between ``_``, trailing digits dropped): the key is secret.
SECRET_WORDS = frozenset(("PASS", "PWD", "PW", "PAT", "KEY", "KEYS", "AUTH", "CREDS", "DSN", "COOKIE", "SALT",
                          "SIGNATURE", "CERTKEY"))
#: Kept for callers that matched keys with a pattern: the parts above, as one.
SECRET_KEY = re.compile("|".join(SECRET_PARTS), re.IGNORECASE)
#: ``scheme://USERINFO@``: userinfo runs to the authority's last ``@`` (a password may hold one).
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]*)@")


def secret_key(key: str, marked: Iterable[str] = ()) -> bool:
    """Whether *key*'s value is masked whole (see the module's rule)."""
    if key in set(marked):
        return True
    upper = key.upper()
    if SECRET_KEY.search(upper):
        return True
    return any(word.rstrip("0123456789") in SECRET_WORDS for word in upper.split("_"))


def _mask_userinfo(m: re.Match) -> str:
    user, sep, _password = m.group("userinfo").partition(":")
    return f"{m.group('scheme')}{user}:{MASK}@" if sep else f"{m.group('scheme')}{MASK}@"


def mask_value(key: str, value: str, marked: Iterable[str] = ()) -> str:
    """*value* as shown and recorded: :data:`MASK` for a secret key, else with URL credentials masked."""
    if secret_key(key, marked):
        return MASK
    return _URL_USERINFO.sub(_mask_userinfo, value)


def mask_env(env: Mapping[str, str], marked: Iterable[str] = ()) -> dict[str, str]:
    """*env* with every secret value masked (:func:`mask_value`), keys and order kept."""
    marked = frozenset(marked)
    return {k: mask_value(k, v, marked) for k, v in env.items()}


def was_masked(key: str, value: str, marked: Iterable[str] = ()) -> bool:
    """Whether a recorded *value* is a masked one (the real value must be given again): the mask
    itself for a secret key, or a URL whose credentials read as the mask."""
    if secret_key(key, marked):
        return value == MASK
    return any(m.group("userinfo") == MASK or m.group("userinfo").endswith(":" + MASK)
               for m in _URL_USERINFO.finditer(value))


#: A shell assignment in a setup line: ``KEY=VALUE`` (after ``export``/``declare -x``/``readonly``
#: or before a command), the value unquoted, "double" or 'single' quoted.
_ASSIGNMENT = re.compile(r"""(?<![^\s;&|(])(?P<key>[A-Za-z_][A-Za-z0-9_]*)="""
                         r"""(?P<value>"(?:[^"\\]|\\.)*"?|'[^']*'?|(?:[^\s;&|()'"\\]|\\.)*)""")
#: Inventory variables that hold shell lines: masked by :func:`mask_setup_line`.
SHELL_VARS = ("ddpfab_setup",)


def mask_setup_line(line: str, marked: Iterable[str] = ()) -> str:
    """A setup line (shell) as shown and recorded: each assignment whose key is secret
    (``export HF_TOKEN=hf_x``, ``WANDB_API_KEY=x cmd``, ``export X="..."`` with X marked) shows
    ``KEY=***``; a URL's credentials anywhere in it are masked as in a value (:func:`mask_value`)."""
    marked = frozenset(marked)

    def one(m: re.Match) -> str:
        key = m.group("key")
        return f"{key}={MASK}" if secret_key(key, marked) else m.group(0)

    return _URL_USERINFO.sub(_mask_userinfo, _ASSIGNMENT.sub(one, line))


def mask_setup(lines: Iterable[str], marked: Iterable[str] = ()) -> tuple[str, ...]:
    """Every line of *lines* masked (:func:`mask_setup_line`)."""
    marked = frozenset(marked)
    return tuple(mask_setup_line(line, marked) for line in lines)


def setup_was_masked(line: str) -> bool:
    """Whether a recorded setup *line* has a masked value in it (the real line must be given again)."""
    return any(m.group("value") == MASK for m in _ASSIGNMENT.finditer(line))


def recordable(value: Any, key: str = "") -> Any:
    """*value* (an extra var: any YAML data) as a record keeps it: a secret key's value masked at
    any depth (``{"db": {"password": ...}}`` too), and what JSON cannot hold (a YAML date) as text."""
    if key and secret_key(key):
        return MASK
    if key in SHELL_VARS and isinstance(value, (str, list)):
        lines = value.splitlines() if isinstance(value, str) else value
        masked = [mask_setup_line(line) if isinstance(line, str) else recordable(line) for line in lines]
        return "\n".join(masked) if isinstance(value, str) else masked
    if isinstance(value, Mapping):
        return {str(k): recordable(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [recordable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def holds_mask(value: Any, key: str = "") -> bool:
    """Whether a recorded *value* (see :func:`recordable`) has a masked secret in it, at any depth."""
    if key and secret_key(key):
        return value == MASK
    if key in SHELL_VARS and isinstance(value, (str, list)):
        lines = value.splitlines() if isinstance(value, str) else value
        return any(isinstance(line, str) and setup_was_masked(line) for line in lines)
    if isinstance(value, Mapping):
        return any(holds_mask(v, str(k)) for k, v in value.items())
    if isinstance(value, list):
        return any(holds_mask(v) for v in value)
    return False
