"""The store's schema, written once for both databases.

Each migration is SQL that SQLite and PostgreSQL both understand, with ``{real}``, ``{serial}``
and ``{json}`` standing for the few types they spell differently; where they cannot share one
(SQLite cannot change a CHECK constraint, it rebuilds the table), a migration has a script per
database. A store applies those newer than its recorded version, in order.
"""

from __future__ import annotations

from typing import Literal

Dialect = Literal["sqlite", "postgresql"]

TYPES: dict[Dialect, dict[str, str]] = {
    "sqlite": {
        "real": "REAL",
        "serial": "INTEGER PRIMARY KEY AUTOINCREMENT",
        "json": "TEXT",
    },
    "postgresql": {
        "real": "DOUBLE PRECISION",
        "serial": "BIGSERIAL PRIMARY KEY",
        "json": "JSONB",
    },
}

TURN_COLUMNS = (
    "turn_id, session_id, owner, prompt, status, result, text, drone_id, created_at, ended_at"
)

MIGRATIONS: list[str | dict[Dialect, str]] = [
    """
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        title TEXT NOT NULL,
        created_at {real} NOT NULL
    );
    CREATE INDEX sessions_owner ON sessions (owner, created_at);
    CREATE TABLE turns (
        turn_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions (session_id),
        owner TEXT NOT NULL,
        prompt TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('processing', 'finished', 'aborted', 'error')),
        result TEXT,
        text TEXT NOT NULL DEFAULT '',
        drone_id TEXT,
        created_at {real} NOT NULL,
        ended_at {real}
    );
    CREATE INDEX turns_session ON turns (session_id, created_at);
    CREATE TABLE messages (
        message_id {serial},
        turn_id TEXT NOT NULL REFERENCES turns (turn_id),
        body {json} NOT NULL
    );
    CREATE INDEX messages_turn ON messages (turn_id, message_id);
    """,
    # One processing turn per session.
    """
    CREATE UNIQUE INDEX IF NOT EXISTS one_processing_turn ON turns (session_id)
        WHERE status = 'processing';
    """,
    # The two stores had drifted: one index of processing turns for both.
    """
    DROP INDEX IF EXISTS turns_status;
    CREATE INDEX IF NOT EXISTS turns_processing ON turns (status) WHERE status = 'processing';
    """,
    # Accounts: people, their login sessions and API tokens; drones' tokens; failed logins;
    # and revocations, which every relay follows to drop what was revoked.
    """
    CREATE TABLE users (
        user_id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        password_hash TEXT,
        role TEXT NOT NULL CHECK (role IN ('admin', 'member')),
        created_at {real} NOT NULL
    );
    CREATE TABLE logins (
        token_hash TEXT PRIMARY KEY,
        user_id TEXT NOT NULL REFERENCES users (user_id) ON DELETE CASCADE,
        created_at {real} NOT NULL,
        expires_at {real} NOT NULL
    );
    CREATE INDEX logins_user ON logins (user_id);
    CREATE TABLE api_tokens (
        token_hash TEXT PRIMARY KEY,
        user_id TEXT NOT NULL REFERENCES users (user_id) ON DELETE CASCADE,
        label TEXT NOT NULL,
        created_at {real} NOT NULL
    );
    CREATE INDEX api_tokens_user ON api_tokens (user_id);
    CREATE TABLE drone_tokens (
        name TEXT PRIMARY KEY,
        token_hash TEXT NOT NULL,
        created_at {real} NOT NULL,
        revoked_at {real}
    );
    CREATE TABLE login_failures (
        failure_key TEXT PRIMARY KEY,
        failures INTEGER NOT NULL,
        since {real} NOT NULL
    );
    CREATE TABLE revocations (
        revocation_id {serial},
        kind TEXT NOT NULL CHECK (kind IN ('login', 'token', 'user', 'drone')),
        revoked TEXT NOT NULL,
        at {real} NOT NULL
    );
    """,
    # The queue and honest endings: turns may wait ("queued"), for a drone the person picked;
    # every ending stores why and who; an abort asked for is kept; tokens used are counted.
    {
        "postgresql": """
        ALTER TABLE turns DROP CONSTRAINT turns_status_check;
        ALTER TABLE turns ADD CONSTRAINT turns_status_check
            CHECK (status IN ('queued', 'processing', 'finished', 'aborted', 'error'));
        ALTER TABLE turns ADD COLUMN wanted_drone TEXT;
        ALTER TABLE turns ADD COLUMN started_at DOUBLE PRECISION;
        ALTER TABLE turns ADD COLUMN reason TEXT;
        ALTER TABLE turns ADD COLUMN ended_by TEXT;
        ALTER TABLE turns ADD COLUMN abort_requested_by TEXT;
        ALTER TABLE turns ADD COLUMN prompt_tokens INTEGER;
        ALTER TABLE turns ADD COLUMN completion_tokens INTEGER;
        ALTER TABLE turns ADD COLUMN usage_estimated INTEGER;
        CREATE INDEX turns_queued ON turns (created_at) WHERE status = 'queued';
        CREATE INDEX turns_drone ON turns (drone_id) WHERE status = 'processing';
        CREATE INDEX turns_served ON turns (owner, started_at);
        """,
        "sqlite": f"""
        CREATE TABLE turns_next (
            turn_id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (session_id),
            owner TEXT NOT NULL,
            prompt TEXT NOT NULL,
            status TEXT NOT NULL
                CHECK (status IN ('queued', 'processing', 'finished', 'aborted', 'error')),
            result TEXT,
            text TEXT NOT NULL DEFAULT '',
            drone_id TEXT,
            created_at REAL NOT NULL,
            ended_at REAL,
            wanted_drone TEXT,
            started_at REAL,
            reason TEXT,
            ended_by TEXT,
            abort_requested_by TEXT,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            usage_estimated INTEGER
        );
        INSERT INTO turns_next ({TURN_COLUMNS}) SELECT {TURN_COLUMNS} FROM turns;
        DROP TABLE turns;
        ALTER TABLE turns_next RENAME TO turns;
        CREATE INDEX turns_session ON turns (session_id, created_at);
        CREATE INDEX turns_processing ON turns (status) WHERE status = 'processing';
        CREATE UNIQUE INDEX one_processing_turn ON turns (session_id)
            WHERE status = 'processing';
        CREATE INDEX turns_queued ON turns (created_at) WHERE status = 'queued';
        CREATE INDEX turns_drone ON turns (drone_id) WHERE status = 'processing';
        CREATE INDEX turns_served ON turns (owner, started_at);
        """,
    },
    # Sessions listed by last activity (a turn created or ended, a rename), a page at a time.
    # The triggers keep it whoever writes the turn; a rebuild of ``turns`` must recreate them.
    {
        "postgresql": """
        ALTER TABLE sessions ADD COLUMN last_activity DOUBLE PRECISION NOT NULL DEFAULT 0;
        UPDATE sessions SET last_activity = GREATEST(created_at, (
            SELECT max(GREATEST(created_at, ended_at)) FROM turns
            WHERE turns.session_id = sessions.session_id));
        DROP INDEX IF EXISTS sessions_owner;
        CREATE INDEX sessions_activity ON sessions (owner, last_activity, session_id);
        CREATE INDEX sessions_recent ON sessions (last_activity, session_id);
        CREATE FUNCTION hangar_session_activity() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE sessions SET last_activity = GREATEST(last_activity, NEW.created_at,
                NEW.ended_at) WHERE session_id = NEW.session_id;
            RETURN NULL;
        END $$;
        CREATE TRIGGER turn_created AFTER INSERT ON turns
            FOR EACH ROW EXECUTE FUNCTION hangar_session_activity();
        CREATE TRIGGER turn_ended AFTER UPDATE OF ended_at ON turns
            FOR EACH ROW WHEN (NEW.ended_at IS NOT NULL)
            EXECUTE FUNCTION hangar_session_activity();
        """,
        "sqlite": """
        ALTER TABLE sessions ADD COLUMN last_activity REAL NOT NULL DEFAULT 0;
        UPDATE sessions SET last_activity = max(created_at, COALESCE((
            SELECT max(max(created_at, COALESCE(ended_at, 0))) FROM turns
            WHERE turns.session_id = sessions.session_id), 0));
        DROP INDEX IF EXISTS sessions_owner;
        CREATE INDEX sessions_activity ON sessions (owner, last_activity, session_id);
        CREATE INDEX sessions_recent ON sessions (last_activity, session_id);
        CREATE TRIGGER turn_created AFTER INSERT ON turns BEGIN
            UPDATE sessions SET last_activity = max(last_activity, NEW.created_at)
            WHERE session_id = NEW.session_id;
        END;
        CREATE TRIGGER turn_ended AFTER UPDATE OF ended_at ON turns
            WHEN NEW.ended_at IS NOT NULL BEGIN
            UPDATE sessions SET last_activity = max(last_activity, NEW.ended_at)
            WHERE session_id = NEW.session_id;
        END;
        """,
    },
    # A submit sent again (its answer was lost) finds the turn it made by the client's key.
    """
    ALTER TABLE turns ADD COLUMN request_id TEXT;
    CREATE UNIQUE INDEX turns_request ON turns (owner, request_id);
    """,
    # "Always for this session": kept with the session, not in Redis or a relay's memory.
    """
    CREATE TABLE session_tools (
        session_id TEXT NOT NULL REFERENCES sessions (session_id),
        tool TEXT NOT NULL,
        PRIMARY KEY (session_id, tool)
    );
    """,
    # A drone's message keeps its number: one sent again is known by it, also after a refusal.
    "ALTER TABLE messages ADD COLUMN number INTEGER;",
    # An answer is stored once: an ended turn whose messages hold its text keeps none of its own.
    {
        "postgresql": """
        UPDATE turns SET text = '' WHERE status IN ('finished', 'aborted', 'error')
            AND text <> '' AND text = (
                SELECT string_agg(body->>'content', '' ORDER BY message_id) FROM messages
                WHERE messages.turn_id = turns.turn_id AND body->>'role' = 'assistant');
        """,
        "sqlite": """
        UPDATE turns SET text = '' WHERE status IN ('finished', 'aborted', 'error')
            AND text <> '' AND text = (
                SELECT group_concat(said, '') FROM (
                    SELECT json_extract(body, '$.content') AS said FROM messages
                    WHERE messages.turn_id = turns.turn_id
                        AND json_extract(body, '$.role') = 'assistant'
                    ORDER BY message_id));
        """,
    },
    # A relay without Redis writes its running turns' text as it streams (``running_text``).
    """
    CREATE TABLE turn_pieces (
        turn_id TEXT NOT NULL,
        at INTEGER NOT NULL,
        piece TEXT NOT NULL
    );
    CREATE INDEX turn_pieces_turn ON turn_pieces (turn_id, at);
    """,
    # What a message's place in its conversation depends on, beside it (``closing.SHAPES``).
    {
        "postgresql": """
        ALTER TABLE messages ADD COLUMN role TEXT;
        ALTER TABLE messages ADD COLUMN answers TEXT;
        ALTER TABLE messages ADD COLUMN calls TEXT;
        UPDATE messages SET role = body->>'role', answers = body->>'toolCallId',
            calls = (SELECT coalesce(jsonb_agg(c->'id'), '[]') FROM jsonb_array_elements(
                CASE jsonb_typeof(body->'toolCalls') WHEN 'array' THEN body->'toolCalls'
                ELSE '[]' END) c)::text;
        """,
        "sqlite": """
        ALTER TABLE messages ADD COLUMN role TEXT;
        ALTER TABLE messages ADD COLUMN answers TEXT;
        ALTER TABLE messages ADD COLUMN calls TEXT;
        UPDATE messages SET role = json_extract(body, '$.role'),
            answers = json_extract(body, '$.toolCallId'),
            calls = (SELECT json_group_array(json_extract(value, '$.id'))
                FROM json_each(body, '$.toolCalls'));
        """,
    },
    # When the drone took a claimed turn's order: one claimed by a relay that died before it
    # sent the order is found, and sent again (``queue.UNACCEPTED``).
    """
    ALTER TABLE turns ADD COLUMN accepted_at {real};
    UPDATE turns SET accepted_at = started_at WHERE status = 'processing';
    CREATE INDEX turns_unaccepted ON turns (started_at)
        WHERE status = 'processing' AND accepted_at IS NULL;
    """,
    # One person, and one drone with a token, per name in any case, also when two are added at
    # once (the name's check and the insert are two statements). Names that already differ only
    # in case, from before such names were refused, keep no key: both still log in.
    """
    ALTER TABLE users ADD COLUMN name_key TEXT;
    UPDATE users SET name_key = lower(name) WHERE NOT EXISTS (SELECT 1 FROM users AS other
        WHERE lower(other.name) = lower(users.name) AND other.user_id <> users.user_id);
    CREATE UNIQUE INDEX users_one_per_key ON users (name_key);
    ALTER TABLE drone_tokens ADD COLUMN name_key TEXT;
    UPDATE drone_tokens SET name_key = lower(name) WHERE NOT EXISTS (
        SELECT 1 FROM drone_tokens AS other WHERE lower(other.name) = lower(drone_tokens.name)
        AND other.name <> drone_tokens.name AND other.revoked_at IS NULL);
    CREATE UNIQUE INDEX drone_tokens_one_per_key ON drone_tokens (name_key)
        WHERE revoked_at IS NULL;
    """,
]


def migrations(dialect: Dialect) -> list[str]:
    """Every migration, rendered for ``dialect``; migration N is at index N - 1."""
    return [
        (script if isinstance(script, str) else script[dialect]).format(**TYPES[dialect])
        for script in MIGRATIONS
    ]
