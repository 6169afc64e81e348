"""Fixtures shared by the test areas."""

from __future__ import annotations

import pytest

import pipetrace.runtime.launch


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to start ranks (a command line refused before launch)."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(pipetrace.runtime.launch, "launch", refuse)
