-- Demand beside what was served: the rate of requests that got their
-- first token (request_rate is now the rate they arrived at, refusals
-- included) and the requests awaiting a first token at the gateways when
-- the interval ended (the backlog). Rows written before this migration
-- read 0 (not observed).
ALTER TABLE planner_observations ADD COLUMN served_rate DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE planner_observations ADD COLUMN awaiting_first_token DOUBLE PRECISION NOT NULL DEFAULT 0;
