"""The machine's process table, read from /proc, for tests that check which processes end with
which (a killed inference process and its engines, `grpo serve` and its children)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple


class ProcessRow(NamedTuple):
    pid: int
    state: str  # "Z": a zombie, ended and waiting for its parent to reap it
    parent: int
    group: int


def process_table() -> list[ProcessRow]:
    """Every process now, from /proc/<pid>/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while we looked
        found.append(ProcessRow(int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie waiting to be reaped is gone)."""
    return any(row.group == pgid and row.state != "Z" for row in process_table())


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies count as ended)."""
    return {row.pid for row in process_table() if row.pid in pids and row.state != "Z"}


def descendants(pid: int) -> set[int]:
    """The children of ``pid``, theirs, and so on, as the table stands now."""
    children: dict[int, list[int]] = {}
    for row in process_table():
        children.setdefault(row.parent, []).append(row.pid)
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children.get(child, []))
    return found
