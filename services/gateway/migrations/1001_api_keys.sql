-- The gateway's API keys, when kept in a database (`--api-keys-database`)
-- rather than a file: one set of rows per namespace, so the gateways of a
-- deployment read the same keys and deployments may share one database
-- (the planner's too: the gateway's migrations are numbered from 1001, the
-- planner's below 1000). Written for PostgreSQL and SQLite: plain types.
--
-- Who writes: operators, with `turbine keys new|revoke --database`
-- (holders of the database's credentials). The gateways only read.
CREATE TABLE gateway_api_keys (
    namespace TEXT NOT NULL,
    -- In logs and metrics; unique in the namespace, revoked keys included,
    -- so a name in an old log names one key.
    name TEXT NOT NULL,
    -- Whose prompt cache the key's requests use.
    tenant TEXT NOT NULL,
    -- The hex SHA-256 digest of the key (never the key).
    sha256 TEXT NOT NULL,
    -- A named prompt cache shared by every key naming it, or NULL.
    share_prefixes TEXT,
    -- Limits, NULL for none.
    requests_per_minute BIGINT,
    tokens_per_minute BIGINT,
    max_concurrent BIGINT,
    created_at_unix_ms BIGINT NOT NULL,
    -- Set when revoked: refused from then on; the row stays for the audit.
    revoked_at_unix_ms BIGINT,
    PRIMARY KEY (namespace, name)
);

CREATE UNIQUE INDEX gateway_api_keys_digest ON gateway_api_keys (namespace, sha256);
