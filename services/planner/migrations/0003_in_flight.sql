-- What each pool held when an interval ended, beside what finished in it:
-- the sequences its workers were running, the mean KV cache each held
-- (tokens), and the requests that finished per second. A decode pool is
-- sized for the sequences it will hold by the next interval (what runs,
-- plus what starts, less what finishes), which needs no request's length:
-- at a start no request has finished. Rows written before this migration
-- read 0 (not observed).
ALTER TABLE planner_observations ADD COLUMN running BIGINT NOT NULL DEFAULT 0;
ALTER TABLE planner_observations ADD COLUMN context_tokens DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE planner_observations ADD COLUMN finish_rate DOUBLE PRECISION NOT NULL DEFAULT 0;
-- The mean inter-token latency (per request, milliseconds) beside the
-- percentile: Little's law counts the sequences decoding at the mean.
-- NULL where the interval gave none.
ALTER TABLE planner_observations ADD COLUMN itl_mean_ms DOUBLE PRECISION;
