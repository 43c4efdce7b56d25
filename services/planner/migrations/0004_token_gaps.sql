-- Read while requests run, before any has finished (a start): the mean
-- time between the tokens streamed in the interval (milliseconds, NULL
-- where fewer than ten were) and the mean prompt of the requests that got
-- their first token (tokens, 0 where fewer than ten did). Rows written
-- before this migration read NULL and 0 (not observed).
ALTER TABLE planner_observations ADD COLUMN token_gap_ms DOUBLE PRECISION;
ALTER TABLE planner_observations ADD COLUMN started_isl_mean DOUBLE PRECISION NOT NULL DEFAULT 0;
