-- What each pool held when an interval ended, beside what finished in it:
-- the sequences its workers were running and the mean KV cache each held
-- (tokens). A planner that does not yet know the requests' lengths (none
-- finished) sizes a decode pool on them. Rows written before this
-- migration read 0 (not observed).
ALTER TABLE planner_observations ADD COLUMN running BIGINT NOT NULL DEFAULT 0;
ALTER TABLE planner_observations ADD COLUMN context_tokens DOUBLE PRECISION NOT NULL DEFAULT 0;
