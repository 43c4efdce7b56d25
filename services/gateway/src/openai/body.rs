//! Reading request bodies: size limit (413), time limit (408) and JSON
//! with the offending parameter named (400), all as OpenAI error JSON.

use axum::body::Body;
use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt, Limited};
use serde::de::DeserializeOwned;
use std::time::Duration;

use crate::error::{ErrorKind, GatewayError};

/// An oversized body is read and discarded up to this many bytes, so the
/// client (still sending) gets to read the 413 instead of a reset
/// connection; beyond it the connection is closed.
const DRAIN_LIMIT: u64 = 64 << 20;

/// Reads the whole body, refusing more than `limit` bytes and a body
/// that has not arrived within `timeout` (a client sending it slowly would
/// otherwise hold its place among the requests admitted for as long as it
/// likes).
pub async fn read_limited(headers: &HeaderMap, body: Body, limit: usize, timeout: Duration) -> Result<Bytes, GatewayError> {
    match tokio::time::timeout(timeout, read_within_limit(headers, body, limit)).await {
        Ok(read) => read,
        Err(_) => {
            crate::metrics::body_timed_out();
            Err(GatewayError::new(
                ErrorKind::RequestTimeout,
                format!("The request body did not arrive within {} seconds; send it at once.", timeout.as_secs_f64()),
            ))
        }
    }
}

async fn read_within_limit(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, GatewayError> {
    let too_large = || GatewayError::new(ErrorKind::PayloadTooLarge, format!("The request body exceeds the limit of {limit} bytes."));
    let declared = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if let Some(length) = declared
        && length > limit as u64
    {
        if length <= DRAIN_LIMIT {
            drain(body).await;
        }
        return Err(too_large());
    }
    let mut body = body;
    let mut collected = Vec::new();
    loop {
        match body.frame().await {
            None => return Ok(Bytes::from(collected)),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else { continue };
                if collected.len() + data.len() > limit {
                    drain(body).await;
                    return Err(too_large());
                }
                collected.extend_from_slice(&data);
            }
            Some(Err(error)) => return Err(GatewayError::new(ErrorKind::InvalidRequest, format!("could not read the request body: {error}"))),
        }
    }
}

/// Reads and discards up to [`DRAIN_LIMIT`] bytes of a body.
async fn drain(body: Body) {
    let _ = Limited::new(body, DRAIN_LIMIT as usize).collect().await;
}

/// Parses JSON, naming the parameter whose value has the wrong type.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, GatewayError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(GatewayError::new(ErrorKind::InvalidRequest, "The request body is empty; send a JSON object."));
    }
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        match inner.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof | serde_json::error::Category::Io => {
                GatewayError::new(ErrorKind::InvalidRequest, format!("We could not parse the JSON body of your request: {inner}"))
            }
            serde_json::error::Category::Data => {
                let message = strip_position(&inner.to_string());
                if path == "." {
                    // A missing field or a body that is not an object.
                    let param = missing_field(&message);
                    GatewayError { kind: ErrorKind::InvalidRequest, message: format!("Invalid request: {message}"), param, retry_after: None }
                } else {
                    GatewayError::invalid(path.clone(), format!("Invalid value for '{path}': {message}"))
                }
            }
        }
    })
}

/// serde_json appends " at line L column C"; clients need not see it.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(index) => message[..index].to_owned(),
        None => message.to_owned(),
    }
}

fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    Some(rest[..rest.find('`')?].to_owned())
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Request {
        model: String,
        max_tokens: Option<i64>,
    }

    #[test]
    fn errors_name_the_parameter() {
        let error = parse_json::<Request>(br#"{"model": "m", "max_tokens": "ten"}"#).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("max_tokens"));
        assert!(!error.message.contains("line"), "{}", error.message);
        let error = parse_json::<Request>(br#"{"max_tokens": 3}"#).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("model"));
        let error = parse_json::<Request>(br#"{"model": "m""#).unwrap_err();
        assert!(error.message.contains("could not parse"));
        assert!(parse_json::<Request>(b"  ").unwrap_err().message.contains("empty"));
        assert!(parse_json::<Request>(b"[1]").is_err());
    }
}
