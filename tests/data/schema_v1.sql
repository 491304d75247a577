-- The schema of anarchon_lite's first release (user_version 1), for the migration test.
CREATE TABLE IF NOT EXISTS jobs (
        name TEXT PRIMARY KEY,
        schedule TEXT NOT NULL,
        paused INTEGER NOT NULL DEFAULT 0,
        last_slot INTEGER NOT NULL,
        next_slot INTEGER
    );
CREATE TABLE IF NOT EXISTS runs (
        job TEXT NOT NULL,
        slot INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('pending', 'running')),
        not_before INTEGER NOT NULL,
        failures INTEGER NOT NULL DEFAULT 0,
        owner TEXT,
        owner_pid INTEGER,
        owner_start INTEGER,
        owner_ns TEXT,
        boot_id TEXT,
        lease_until REAL,
        lease REAL,
        cancel INTEGER NOT NULL DEFAULT 0,
        progress_done REAL,
        progress_total REAL,
        started_at INTEGER,
        PRIMARY KEY (job, slot)
    );
CREATE TABLE IF NOT EXISTS history (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job TEXT NOT NULL,
        slot INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        status TEXT NOT NULL,
        instance TEXT,
        started_at INTEGER,
        finished_at INTEGER,
        error TEXT,
        output TEXT,
        UNIQUE (job, slot, attempt)
    );
CREATE INDEX IF NOT EXISTS history_by_job ON history (job, id);
CREATE INDEX IF NOT EXISTS history_by_slot ON history (slot);
CREATE TABLE IF NOT EXISTS instances (
        instance TEXT PRIMARY KEY,
        pid INTEGER NOT NULL,
        start INTEGER,
        namespace TEXT,
        boot_id TEXT,
        started_at INTEGER NOT NULL
    );
CREATE TABLE IF NOT EXISTS checkpoints (
        job TEXT NOT NULL,
        slot INTEGER NOT NULL,
        value TEXT NOT NULL,
        updated_at INTEGER NOT NULL,
        PRIMARY KEY (job, slot)
    );
PRAGMA user_version = 1;
