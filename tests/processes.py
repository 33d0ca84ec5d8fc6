"""Checks on OS processes by pid, for tests that must prove a process is gone."""

from __future__ import annotations

import time

import psutil


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its exit status is left).

    ``is_running`` compares the start time too, so a reused pid does not count.
    """
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(procs: list[psutil.Process], within_s: float) -> list[psutil.Process]:
    """The processes still alive after waiting up to ``within_s`` for all to be gone."""
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p in procs if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
