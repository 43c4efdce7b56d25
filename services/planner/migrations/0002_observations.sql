-- What each pool did in each interval: the predictors' history (a
-- restarted planner reads it back and forecasts as before) and the record
-- of SLA attainment.
CREATE TABLE planner_observations (
    namespace TEXT NOT NULL,
    -- When the interval ended.
    at_unix_ms BIGINT NOT NULL,
    pool TEXT NOT NULL,
    -- The deployment's requests per second and mean input and output
    -- lengths, tokens.
    request_rate DOUBLE PRECISION NOT NULL,
    isl_mean DOUBLE PRECISION NOT NULL,
    osl_mean DOUBLE PRECISION NOT NULL,
    -- At the targets' percentile, milliseconds; NULL when no request
    -- gave one during the interval.
    ttft_ms DOUBLE PRECISION,
    itl_ms DOUBLE PRECISION,
    -- The pool's requests waiting and KV cache in use (a fraction) when
    -- the interval ended, and its replicas.
    queue_depth DOUBLE PRECISION NOT NULL,
    kv_usage DOUBLE PRECISION NOT NULL,
    replicas BIGINT NOT NULL,
    PRIMARY KEY (namespace, at_unix_ms, pool)
);
