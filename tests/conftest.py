"""Fixtures shared by the test areas."""

from __future__ import annotations

import pytest

import pipetrace.runtime.launch


@pytest.fixture(autouse=True, scope="session")
def _private_cache_home(tmp_path_factory):
    """Keep the secret that signs kept analyses (`analyze.kept_analysis`) out of the home
    directory of whoever runs the tests (rank subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to start ranks (a command line refused before launch)."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(pipetrace.runtime.launch, "launch", refuse)
