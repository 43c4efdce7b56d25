-- PostgreSQL only, beside the shared migrations (services/gateway/migrations):
-- every change to the API keys table is announced on the channel
-- gateway_api_keys, its payload the namespace changed ('' after a
-- TRUNCATE: every namespace). The gateways listening read their keys again
-- at once rather than at their next --api-keys-reload-secs, so a key
-- revoked, by `turbine keys revoke` or by hand, is refused everywhere
-- within moments. An announcement only makes a gateway read the table:
-- what it then applies is what the rows say, whoever sent it.
CREATE FUNCTION gateway_api_keys_announce() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM pg_notify('gateway_api_keys', '');
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('gateway_api_keys', OLD.namespace);
    ELSE
        PERFORM pg_notify('gateway_api_keys', NEW.namespace);
        IF TG_OP = 'UPDATE' AND OLD.namespace <> NEW.namespace THEN
            PERFORM pg_notify('gateway_api_keys', OLD.namespace);
        END IF;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER gateway_api_keys_announce AFTER INSERT OR UPDATE OR DELETE ON gateway_api_keys
    FOR EACH ROW EXECUTE FUNCTION gateway_api_keys_announce();

CREATE TRIGGER gateway_api_keys_announce_truncate AFTER TRUNCATE ON gateway_api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION gateway_api_keys_announce();
