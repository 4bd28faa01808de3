"""The SQLite store's writes, committed together when they meet (a group commit).

Every statement runs on the store's one thread. The writes that arrive while it is busy run
there in one transaction once it is free, each in a savepoint of its own: one that fails is
rolled back alone and the others stand; if the commit itself fails, none does and each caller
hears so. The batch is answered in one hand-over to the event loop. A burst of turn endings
then costs one commit and one wake-up of the loop, not one of each per write.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _Write(Generic[T]):
    work: Callable[[sqlite3.Connection], T]
    done: asyncio.Future[T]


Answer = tuple[_Write[Any], Any, BaseException | None]


class GroupCommit:
    def __init__(self, connection: Callable[[], sqlite3.Connection]) -> None:
        self._connection = connection
        self._waiting: list[_Write[Any]] = []
        """Writes waiting for the thread (added on the loop, taken on the thread)."""
        self._lock = threading.Lock()
        self._sent = False
        """A batch is on its way to the thread and has not taken the waiting writes yet."""

    async def write(self, thread: ThreadPoolExecutor, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` and commit it (with the writes beside it), or roll it back if it
        fails, on ``thread``."""
        loop = asyncio.get_running_loop()
        write: _Write[T] = _Write(work, loop.create_future())
        with self._lock:
            self._waiting.append(write)
            send, self._sent = not self._sent, True
        if send:
            thread.submit(self._commit_waiting, loop)
        return await write.done

    def _commit_waiting(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the thread: every waiting write in one transaction, a savepoint each."""
        with self._lock:
            waiting, self._waiting, self._sent = self._waiting, [], False
        batch = [write for write in waiting if not write.done.cancelled()]  # its caller left
        if batch:
            loop.call_soon_threadsafe(_answer, self._commit(batch))

    def _commit(self, batch: list[_Write[Any]]) -> list[Answer]:
        answers: list[Answer] = []
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connection()
            if len(batch) == 1:
                write = batch[0]
                try:
                    answers.append((write, write.work(conn), None))
                except BaseException as error:
                    conn.rollback()
                    answers.append((write, None, error))
                else:
                    conn.commit()
                return answers
            conn.execute("BEGIN")
            for write in batch:
                conn.execute("SAVEPOINT hangar_write")
                try:
                    answers.append((write, write.work(conn), None))
                except BaseException as error:
                    conn.execute("ROLLBACK TO hangar_write")
                    answers.append((write, None, error))
                conn.execute("RELEASE hangar_write")
            conn.commit()
            return answers
        except BaseException as error:  # the commit (or the connection) failed: none stands
            if conn is not None:
                conn.rollback()
            return [(write, None, error) for write in batch]


def _answer(answers: list[Answer]) -> None:
    """On the loop: each write's caller gets its result or its error."""
    for write, result, error in answers:
        if write.done.cancelled():
            continue
        if error is not None:
            write.done.set_exception(error)
        else:
            write.done.set_result(result)
