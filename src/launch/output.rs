//! Forwarding the ranks' output line by line, each line prefixed.
//!
//! Every rank stream has a pump task that cuts lines; one writer task per
//! destination (our stdout, our stderr) writes whole lines, so lines from
//! different ranks never interleave within a line.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Longest piece forwarded as one line; longer lines are cut into pieces.
const MAX_LINE: u64 = 64 << 10;
/// Lines buffered per destination before the pumps wait (backpressure).
const QUEUE: usize = 256;

/// Start a task that writes the lines it receives to `out`.
///
/// Write errors (e.g. a closed pipe) are ignored, and lines keep being
/// drained, so ranks never block on a reader that went away.
pub(super) fn writer<W>(mut out: W) -> (mpsc::Sender<Vec<u8>>, JoinHandle<()>)
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(QUEUE);
    let task = tokio::spawn(async move {
        let mut healthy = true;
        while let Some(line) = rx.recv().await {
            if healthy {
                healthy = out.write_all(&line).await.is_ok();
                if healthy && rx.is_empty() {
                    healthy = out.flush().await.is_ok();
                }
            }
        }
        if healthy {
            let _ = out.flush().await;
        }
    });
    (tx, task)
}

/// Start a task that reads `input` and sends each line, prefixed with
/// `[rank] ` when `prefix` is set, to `tx`. A last line without a newline
/// gets one when prefixed, and is passed on as it is otherwise.
pub(super) fn pump<R>(
    rank: u32,
    prefix: bool,
    input: R,
    tx: mpsc::Sender<Vec<u8>>,
) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let tag = format!("[{rank}] ").into_bytes();
        let mut input = BufReader::with_capacity(64 << 10, input);
        loop {
            let mut line = if prefix { tag.clone() } else { Vec::new() };
            let start = line.len();
            match (&mut input)
                .take(MAX_LINE)
                .read_until(b'\n', &mut line)
                .await
            {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if prefix && line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            debug_assert!(line.len() > start);
            if tx.send(line).await.is_err() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn prefixes_whole_lines_and_splits_long_ones() {
        let (tx, mut rx) = mpsc::channel(16);
        let long = vec![b'x'; MAX_LINE as usize + 3];
        let mut input = b"one\ntwo".to_vec();
        input.push(b'\n');
        input.extend_from_slice(&long);
        pump(7, true, std::io::Cursor::new(input), tx)
            .await
            .unwrap();
        let mut lines = Vec::new();
        while let Ok(l) = rx.try_recv() {
            lines.push(l);
        }
        assert_eq!(lines[0], b"[7] one\n");
        assert_eq!(lines[1], b"[7] two\n");
        assert_eq!(lines.len(), 4);
        assert!(lines[2].starts_with(b"[7] xxx") && lines[2].len() == 4 + MAX_LINE as usize + 1);
        assert_eq!(lines[3], b"[7] xxx\n");
    }

    #[tokio::test]
    async fn no_prefix_passes_bytes_through() {
        let (tx, mut rx) = mpsc::channel(16);
        pump(0, false, std::io::Cursor::new(b"a\nb".to_vec()), tx)
            .await
            .unwrap();
        assert_eq!(rx.try_recv().unwrap(), b"a\n");
        assert_eq!(rx.try_recv().unwrap(), b"b");
    }
}
