-- When a key stops authenticating (`turbine keys new --expires-at`), Unix
-- milliseconds; NULL: never. Its holder is refused from then on (401, "has
-- expired"), its row kept as a revoked key's is.
ALTER TABLE gateway_api_keys ADD COLUMN expires_at_unix_ms BIGINT;
