-- The planner's state: one set of rows per namespace (a deployment), so
-- planners of several deployments can share one database. Written for both
-- PostgreSQL (the service) and SQLite (`turbine run --planner`): plain
-- types only, JSON kept as text.

-- What the planner sizes for, and whether it acts.
CREATE TABLE planner_control (
    namespace TEXT PRIMARY KEY,
    -- JSON of the targets in force; NULL before the first SetTargets.
    targets TEXT,
    targets_set_at_unix_ms BIGINT,
    -- 1 paused, 0 acting (an integer: sqlx's Any driver reads no SQLite
    -- boolean).
    paused BIGINT NOT NULL,
    -- Why it was paused, in the operator's words.
    pause_reason TEXT NOT NULL,
    updated_at_unix_ms BIGINT NOT NULL
);

-- Every decision, with its inputs and the numbers behind it.
CREATE TABLE planner_decisions (
    namespace TEXT NOT NULL,
    id BIGINT NOT NULL,
    at_unix_ms BIGINT NOT NULL,
    -- 1 made while paused (nothing executed), else 0.
    paused BIGINT NOT NULL,
    -- The decision as a whole, in words.
    reason TEXT NOT NULL,
    -- JSON of the whole decision: each pool's observation, the prediction,
    -- each pool's current, proposed and desired replicas with the reason,
    -- and the action.
    decision TEXT NOT NULL,
    PRIMARY KEY (namespace, id)
);

-- Each action handed to a connector and where it stands; an action's id
-- is unique, so no action is executed twice.
CREATE TABLE planner_actions (
    id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    decision_id BIGINT NOT NULL,
    pool TEXT NOT NULL,
    replicas BIGINT NOT NULL,
    -- pending, done or failed.
    state TEXT NOT NULL,
    message TEXT NOT NULL,
    updated_at_unix_ms BIGINT NOT NULL
);

CREATE INDEX planner_actions_by_state ON planner_actions (namespace, state);
