"""Settings for the whole suite: nothing it does may depend on what this machine already holds."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _own_caches(tmp_path_factory):
    """The controller's caches (ddpfab's inventory cache among them) start empty for every session,
    so a result never depends on an earlier run's leftovers in ~/.cache."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous
