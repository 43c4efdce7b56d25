use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// A server that reads each request whole and then, for the first
/// `drop_first` connections, closes without answering (as a server closing
/// a kept-alive connection the request went down); later ones answer 200.
async fn server(drop_first: usize) -> (String, tokio::task::JoinHandle<usize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let serving = tokio::spawn(async move {
        let mut connections = 0;
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            connections += 1;
            let mut request = Vec::new();
            let mut buffer = [0u8; 1024];
            while !request.windows(4).any(|window| window == b"\r\n\r\n") || !request.ends_with(b"{}") {
                let read = socket.read(&mut buffer).await.unwrap();
                assert!(read > 0, "the client closed first");
                request.extend_from_slice(&buffer[..read]);
            }
            if connections <= drop_first {
                drop(socket);
                continue;
            }
            socket.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok").await.unwrap();
            return connections;
        }
    });
    (url, serving)
}

#[tokio::test]
async fn a_request_whose_connection_closed_before_any_answer_is_sent_once_more() {
    let http = engine_client().unwrap();
    let (url, serving) = server(1).await;
    let response = send(http.post(&url).json(&serde_json::json!({}))).await.unwrap();
    assert_eq!(response.text().await.unwrap(), "ok");
    assert_eq!(serving.await.unwrap(), 2, "answered on the second connection");

    // Only once: an engine that keeps closing is an error for the caller.
    let (url, serving) = server(2).await;
    assert!(send(http.post(&url).json(&serde_json::json!({}))).await.is_err());
    serving.abort();
}
