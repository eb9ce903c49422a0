"""e2_cpu_harness: upstream's fixtures and teardown made safe on a CPU-only torch.

``e2 test`` loads this plugin into pytest on both sides (``-p e2_cpu_harness``,
its folder on PYTHONPATH after the e2 view), so stock and E2 run under the
same harness and the delta between them still measures the series alone.

What it changes, and only while pytest runs a test's *setup or teardown*
(the fixtures), never its body:

* ``torch.accelerator.empty_cache()`` and ``empty_host_cache()`` do nothing
  when torch has no accelerator. Upstream's ``cleanup_fixture`` (autouse in
  tests/conftest.py) calls ``cleanup_dist_env_and_memory()``, which calls
  them whenever the current platform is not the CPU one; a test that
  monkeypatches the platform (``is_cuda_alike``, ``is_cuda``) makes that
  teardown raise "Cannot access accelerator device when none is available"
  after its body has passed. There is no device cache to empty, so skipping
  the call is what a CPU run means.

A test *body* that calls them still raises as before: a test that needs a
device fails and is classified device-only, never hidden. Nothing a test
asserts is touched. On a machine with an accelerator the plugin does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import ParamSpec, TypeVar

import pytest

GUARDED = ("empty_cache", "empty_host_cache")
_in_fixture = False

P = ParamSpec("P")
R = TypeVar("R")


def _guard(original: Callable[P, R]) -> Callable[P, R | None]:
    @functools.wraps(original)
    def call(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if _in_fixture:
            import torch

            if not torch.accelerator.is_available():
                return None
        return original(*args, **kwargs)

    return call


def pytest_configure(config: pytest.Config) -> None:
    import torch

    if torch.accelerator.is_available():
        return
    for name in GUARDED:
        original = getattr(torch.accelerator, name, None)
        if original is not None:
            setattr(torch.accelerator, name, _guard(original))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _as_fixture_phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item,
                            nextitem: pytest.Item | None) -> Generator[None, object, object]:
    return (yield from _as_fixture_phase())


def _as_fixture_phase() -> Generator[None, object, object]:
    global _in_fixture
    _in_fixture = True
    try:
        return (yield)
    finally:
        _in_fixture = False
