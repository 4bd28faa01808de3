"""The tools a person approved for the rest of a session ("Always for this session"): kept in the
store with the session, so neither a relay's restart nor Redis restarted empty forgets them."""

from __future__ import annotations

from .store import Database


async def approve_always(db: Database, session_id: str, tool: str) -> None:
    """Keep ``tool`` approved for the session (none once the session was deleted)."""
    await db.execute(
        "INSERT INTO session_tools (session_id, tool) SELECT ?, ?"
        " WHERE EXISTS (SELECT 1 FROM sessions WHERE session_id = ?) ON CONFLICT DO NOTHING",
        session_id,
        tool,
        session_id,
    )


async def approved_tools(db: Database, session_id: str) -> list[str]:
    rows = await db.fetch(
        "SELECT tool FROM session_tools WHERE session_id = ? ORDER BY tool", session_id
    )
    return [str(row["tool"]) for row in rows]
