"""The thread that copies staged segments to T0 runs below the upload's priority."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tierckpt.service.memory.persist import _background_thread


def _niceness_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread niceness here")
def test_t0_writer_thread_is_niced_and_the_others_are_not() -> None:
    base = _niceness_of_this_thread()
    with ThreadPoolExecutor(1, initializer=_background_thread, initargs=(7, frozenset())) as writer:
        assert writer.submit(_niceness_of_this_thread).result() == min(19, base + 7)
    with ThreadPoolExecutor(1) as other:
        assert other.submit(_niceness_of_this_thread).result() == base
    assert _niceness_of_this_thread() == base


def test_zero_leaves_the_priority_alone() -> None:
    base = _niceness_of_this_thread()
    with ThreadPoolExecutor(1, initializer=_background_thread, initargs=(0, frozenset())) as writer:
        assert writer.submit(_niceness_of_this_thread).result() == base
