//! The things a benchmark runs over: async-btl itself and the socket
//! baselines, behind one trait so that every test is written once.
//!
//! A wire carries messages whose length both sides know in advance (the
//! benchmark's size), so the stream baselines need no framing header: a
//! message is `write_all` of `len` bytes on one side and `read_exact` of
//! `len` bytes on the other.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr as UnixAddr;

use bytes::Bytes;
use futures::future::{try_join, try_join_all};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{tcp, unix, TcpListener, TcpStream, UdpSocket, UnixListener, UnixStream};

use super::Baseline;
use async_btl::{Endpoint, Error, Fabric, Rank, Receiver, Result, Tag};

/// Payload bytes of one UDP datagram: the largest an IPv4 datagram can
/// carry, just under 64 KiB. Longer messages are cut into datagrams this
/// size.
pub const UDP_CHUNK: usize = 65_507;

/// Receive buffer asked for on UDP sockets (the kernel may grant less,
/// capped by `net.core.rmem_max`; the credit window follows what it grants).
pub const UDP_RCVBUF: usize = 4 << 20;

/// A way to move messages of known length between the two ranks.
///
/// Every method moves whole messages of exactly `len` bytes; the peer
/// calls the mirror method with the same `len`.
#[allow(async_fn_in_trait)] // used through generics on one thread; no Send bound needed
pub trait Wire {
    /// Send one message.
    async fn send(&mut self, len: usize) -> Result<()>;

    /// Receive one message (an error if it has another length).
    async fn recv(&mut self, len: usize) -> Result<()>;

    /// Send `count` messages, as many in flight at once as the wire allows.
    async fn send_window(&mut self, len: usize, count: u64) -> Result<()> {
        for _ in 0..count {
            self.send(len).await?;
        }
        Ok(())
    }

    /// Receive `count` messages.
    async fn recv_window(&mut self, len: usize, count: u64) -> Result<()> {
        for _ in 0..count {
            self.recv(len).await?;
        }
        Ok(())
    }

    /// Send `count` messages and receive `count` at the same time.
    async fn exchange_window(&mut self, len: usize, count: u64) -> Result<()>;
}

fn wrong_length(got: usize, want: usize) -> Error {
    Error::Misuse(format!(
        "benchmark protocol out of step: received {got} bytes where {want} were expected (are both ranks running the same btl-perf with the same options?)"
    ))
}

/// async-btl over an [`Endpoint`]: sends are `Endpoint::send` of a slice of
/// one preallocated buffer (no copy before the transport's own), receives
/// take messages from a tag's [`Receiver`]: up to 1 KiB, and those the
/// transport copies out of its own buffers anyway, into one kept buffer
/// (`Receiver::recv_into`, as MPI and UCX receive into the caller's
/// buffer: the one copy then lands there); the others as the transport's
/// own buffer (`recv`, no copy). Copied anyway are messages below 16 KiB
/// over `sm` and `smcuda` (a larger one lands, by single copy or copied
/// out of its fragment, in a buffer the receiver is handed) and up to
/// 8 KiB over `rdma` (from half a
/// receive buffer, 8 KiB with 16 KiB frames, it hands over the buffer the
/// message arrived in; the 64 KiB frames of `tcp` copy out messages up to
/// 32 KiB); `udp` hands over a slice of the datagram.
pub struct BtlWire {
    ep: Endpoint,
    rx: Receiver,
    tag: Tag,
    data: Bytes,
    into: Vec<u8>,
    /// Messages up to this size are received with `recv_into`.
    into_max: usize,
}

impl BtlWire {
    /// A wire to `ep`'s peer on `tag`, for messages up to `max_len` bytes.
    pub fn new(ep: Endpoint, rx: Receiver, tag: Tag, max_len: usize) -> Self {
        let data = page_aligned_payload(max_len);
        let into_max = match ep.transport() {
            "sm" | "smcuda" => SM_RECV_INTO_MAX,
            "rdma" => RDMA_RECV_INTO_MAX,
            _ => INLINE_MAX,
        };
        BtlWire {
            ep,
            rx,
            tag,
            data,
            into: Vec::with_capacity(into_max),
            into_max,
        }
    }

    fn payload(&self, len: usize) -> Result<Bytes> {
        if len > self.data.len() {
            return Err(self.too_long(len));
        }
        Ok(self.data.slice(..len))
    }

    fn too_long(&self, len: usize) -> Error {
        Error::Misuse(format!(
            "message of {len} bytes is above the wire's {}",
            self.data.len()
        ))
    }
}

/// `len` bytes of a counting pattern that start on a page boundary, as the
/// OSU micro-benchmarks and `ucx_perftest` place their buffers: a kernel
/// single copy (`sm`'s rendezvous, vader's and UCX's CMA) pins every page
/// the source touches, and a 16 KiB message off a page boundary touches
/// five pages instead of four (its copy takes about 1.07x as long).
fn page_aligned_payload(len: usize) -> Bytes {
    const PAGE: usize = 4096;
    let mut v = vec![0u8; len + PAGE];
    let at = (v.as_ptr() as usize).wrapping_neg() % PAGE;
    for (i, b) in v[at..at + len].iter_mut().enumerate() {
        *b = i as u8;
    }
    Bytes::from(v).slice(at..at + len)
}

/// Receive one message of `len` bytes on `rx`: into `into` up to
/// `into_max` bytes, else as the transport's own buffer.
async fn btl_recv(
    rx: &mut Receiver,
    into: &mut Vec<u8>,
    len: usize,
    into_max: usize,
) -> Result<()> {
    let got = if len <= into_max {
        rx.recv_into(into).await?;
        into.len()
    } else {
        rx.recv().await?.data.len()
    };
    expect_len(got, len)
}

/// `Ok` if a message of `got` bytes is the `want` the protocol expects.
fn expect_len(got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(wrong_length(got, want))
    }
}

/// Messages up to this size are sent with `send_inline` (a borrowed slice,
/// copied straight into the transport: no reference count taken and
/// dropped per message), larger ones with `send` of a `Bytes` (which a
/// rendezvous or a udp split message sends without a copy) — what a
/// program that knows the API does.
const INLINE_MAX: usize = 1024;

/// Over `sm`, messages up to this size are received with `recv_into` (see
/// [`BtlWire`]; others up to `INLINE_MAX`).
const SM_RECV_INTO_MAX: usize = 16 * 1024 - 1;

/// The same over `rdma`.
const RDMA_RECV_INTO_MAX: usize = 8 * 1024;

impl Wire for BtlWire {
    async fn send(&mut self, len: usize) -> Result<()> {
        if len <= INLINE_MAX {
            let data = self.data.get(..len).ok_or_else(|| self.too_long(len))?;
            return self.ep.send_inline(self.tag, data).await;
        }
        let p = self.payload(len)?;
        self.ep.send(self.tag, p).await
    }

    async fn recv(&mut self, len: usize) -> Result<()> {
        if len > self.into_max {
            return btl_recv(&mut self.rx, &mut self.into, len, self.into_max).await;
        }
        self.rx.recv_into(&mut self.into).await?;
        expect_len(self.into.len(), len)
    }

    async fn recv_window(&mut self, len: usize, count: u64) -> Result<()> {
        if len > self.into_max {
            for _ in 0..count {
                btl_recv(&mut self.rx, &mut self.into, len, self.into_max).await?;
            }
            return Ok(());
        }
        for _ in 0..count {
            self.rx.recv_into(&mut self.into).await?;
            expect_len(self.into.len(), len)?;
        }
        Ok(())
    }

    /// Start every send of the window, in order, polling each once (most
    /// complete on that poll: the message is in the peer's queue), and wait
    /// for the rest together — the async form of MPI's Isend + Waitall.
    async fn send_window(&mut self, len: usize, count: u64) -> Result<()> {
        if len <= INLINE_MAX {
            let data = self.data.get(..len).ok_or_else(|| self.too_long(len))?;
            let mut pending = Vec::new();
            for _ in 0..count {
                let mut send = self.ep.send_inline(self.tag, data);
                match futures::poll!(&mut send) {
                    std::task::Poll::Ready(r) => r?,
                    std::task::Poll::Pending => pending.push(send),
                }
            }
            try_join_all(pending).await?;
            return Ok(());
        }
        let p = self.payload(len)?;
        let mut pending = Vec::new();
        for _ in 0..count {
            let mut send = self.ep.send(self.tag, p.clone());
            match futures::poll!(&mut send) {
                std::task::Poll::Ready(r) => r?,
                std::task::Poll::Pending => pending.push(send),
            }
        }
        try_join_all(pending).await?;
        Ok(())
    }

    async fn exchange_window(&mut self, len: usize, count: u64) -> Result<()> {
        let p = self.payload(len)?;
        let into_max = self.into_max;
        let (ep, tag, rx, into) = (&self.ep, self.tag, &mut self.rx, &mut self.into);
        let sends = try_join_all((0..count).map(|_| ep.send(tag, p.clone())));
        let recvs = async {
            for _ in 0..count {
                btl_recv(rx, into, len, into_max).await?;
            }
            Ok(())
        };
        try_join(sends, recvs).await?;
        Ok(())
    }
}

/// A byte stream (tokio `UnixStream` or `TcpStream`), split into halves so
/// that both directions can run at once.
pub struct StreamWire<R, W> {
    r: R,
    w: W,
    out: Vec<u8>,
    inb: Vec<u8>,
}

/// The Unix-socket baseline.
pub type UnixWire = StreamWire<unix::OwnedReadHalf, unix::OwnedWriteHalf>;
/// The TCP baseline.
pub type TcpWire = StreamWire<tcp::OwnedReadHalf, tcp::OwnedWriteHalf>;

impl<R, W> StreamWire<R, W> {
    fn new(r: R, w: W, max_len: usize) -> Self {
        StreamWire {
            r,
            w,
            out: (0..max_len).map(|i| i as u8).collect(),
            inb: vec![0; max_len],
        }
    }

    fn check(&self, len: usize) -> Result<()> {
        if len > self.out.len() {
            return Err(Error::Misuse(format!(
                "message of {len} bytes is above the wire's {}",
                self.out.len()
            )));
        }
        Ok(())
    }
}

impl UnixWire {
    /// Wrap a connected Unix stream.
    pub fn unix(s: UnixStream, max_len: usize) -> Self {
        let (r, w) = s.into_split();
        StreamWire::new(r, w, max_len)
    }
}

impl TcpWire {
    /// Wrap a connected TCP stream (sets `TCP_NODELAY`).
    pub fn tcp(s: TcpStream, max_len: usize) -> Result<Self> {
        s.set_nodelay(true)
            .map_err(|e| Error::os("setting TCP_NODELAY", e))?;
        let (r, w) = s.into_split();
        Ok(StreamWire::new(r, w, max_len))
    }
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::os(what, e)
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Wire for StreamWire<R, W> {
    async fn send(&mut self, len: usize) -> Result<()> {
        self.check(len)?;
        self.w
            .write_all(&self.out[..len])
            .await
            .map_err(io("writing to the baseline stream"))
    }

    async fn recv(&mut self, len: usize) -> Result<()> {
        self.check(len)?;
        self.r
            .read_exact(&mut self.inb[..len])
            .await
            .map(drop)
            .map_err(io("reading from the baseline stream"))
    }

    async fn exchange_window(&mut self, len: usize, count: u64) -> Result<()> {
        self.check(len)?;
        let (r, w, out, inb) = (&mut self.r, &mut self.w, &self.out, &mut self.inb);
        let sends = async {
            for _ in 0..count {
                w.write_all(&out[..len])
                    .await
                    .map_err(io("writing to the baseline stream"))?;
            }
            Ok::<(), Error>(())
        };
        let recvs = async {
            for _ in 0..count {
                r.read_exact(&mut inb[..len])
                    .await
                    .map_err(io("reading from the baseline stream"))?;
            }
            Ok(())
        };
        try_join(sends, recvs).await?;
        Ok(())
    }
}

/// UDP on loopback: a connected data socket and a connected control socket
/// per side. A message is one datagram, or several of [`UDP_CHUNK`] bytes.
///
/// Loopback UDP loses datagrams only when the receiver's socket buffer is
/// full, so the sender keeps at most a window of datagrams unconfirmed: the
/// receiver reports its cumulative count on the control socket every half
/// window. The window is sized from the receive buffer the kernel granted,
/// assuming each datagram may cost twice a full chunk of buffer, and is the
/// same for every message size (so both sides always agree on it).
pub struct UdpWire {
    data: UdpSocket,
    ctrl: UdpSocket,
    window: u64,
    sent: u64,
    confirmed: u64,
    received: u64,
    reported: u64,
    out: Vec<u8>,
    inb: Vec<u8>,
}

impl UdpWire {
    /// Bind a data and a control socket on 127.0.0.1; connect them later
    /// with [`UdpWire::connect`]. Returns the wire and the two local ports.
    pub async fn bind(max_len: usize) -> Result<(Self, [u16; 2])> {
        let mut ports = [0u16; 2];
        let mut socks = Vec::new();
        for p in &mut ports {
            let s = UdpSocket::bind("127.0.0.1:0")
                .await
                .map_err(io("binding a UDP baseline socket"))?;
            let _ = socket2::SockRef::from(&s).set_recv_buffer_size(UDP_RCVBUF);
            *p = s
                .local_addr()
                .map_err(io("reading a UDP socket's address"))?
                .port();
            socks.push(s);
        }
        let ctrl = socks.pop().ok_or(Error::Closed)?;
        let data = socks.pop().ok_or(Error::Closed)?;
        let granted = socket2::SockRef::from(&data)
            .recv_buffer_size()
            .map_err(io("reading SO_RCVBUF"))?;
        let window = (granted / (4 * UDP_CHUNK.next_power_of_two())).clamp(2, 256) as u64;
        let wire = UdpWire {
            data,
            ctrl,
            window,
            sent: 0,
            confirmed: 0,
            received: 0,
            reported: 0,
            out: (0..max_len).map(|i| i as u8).collect(),
            inb: vec![0; UDP_CHUNK],
        };
        Ok((wire, ports))
    }

    /// Connect both sockets to the peer's ports.
    pub async fn connect(&self, peer: [u16; 2]) -> Result<()> {
        self.data
            .connect(("127.0.0.1", peer[0]))
            .await
            .map_err(io("connecting the UDP data socket"))?;
        self.ctrl
            .connect(("127.0.0.1", peer[1]))
            .await
            .map_err(io("connecting the UDP control socket"))
    }

    /// Datagrams in flight at most (both sides compute the same number).
    pub fn window(&self) -> u64 {
        self.window
    }

    async fn wait_for_room(&mut self) -> Result<()> {
        let mut b = [0u8; 8];
        while self.sent - self.confirmed >= self.window {
            let n = self
                .ctrl
                .recv(&mut b)
                .await
                .map_err(io("reading a UDP credit report"))?;
            if n == 8 {
                self.confirmed = self.confirmed.max(u64::from_le_bytes(b));
            }
        }
        Ok(())
    }

    async fn counted(&mut self) -> Result<()> {
        self.received += 1;
        if self.received - self.reported >= (self.window / 2).max(1) {
            self.reported = self.received;
            self.ctrl
                .send(&self.received.to_le_bytes())
                .await
                .map_err(io("sending a UDP credit report"))?;
        }
        Ok(())
    }
}

impl Wire for UdpWire {
    async fn send(&mut self, len: usize) -> Result<()> {
        if len > self.out.len() {
            return Err(Error::Misuse(format!("message of {len} bytes is too long")));
        }
        let mut at = 0;
        loop {
            let n = (len - at).min(UDP_CHUNK);
            self.wait_for_room().await?;
            self.data
                .send(&self.out[at..at + n])
                .await
                .map_err(io("sending a UDP datagram"))?;
            self.sent += 1;
            at += n;
            if at >= len {
                return Ok(());
            }
        }
    }

    async fn recv(&mut self, len: usize) -> Result<()> {
        let mut got = 0;
        loop {
            let n = self
                .data
                .recv(&mut self.inb)
                .await
                .map_err(io("receiving a UDP datagram"))?;
            self.counted().await?;
            got += n;
            if got > len {
                return Err(wrong_length(got, len));
            }
            if got == len {
                return Ok(());
            }
        }
    }

    async fn exchange_window(&mut self, _len: usize, _count: u64) -> Result<()> {
        Err(Error::Misuse(
            "the UDP baseline does not run both directions at once".into(),
        ))
    }
}

/// One connected socket baseline.
pub enum SocketWire {
    /// See [`UnixWire`].
    Unix(UnixWire),
    /// See [`TcpWire`].
    Tcp(TcpWire),
    /// See [`UdpWire`].
    Udp(UdpWire),
}

macro_rules! each {
    ($s:expr, $w:ident => $e:expr) => {
        match $s {
            SocketWire::Unix($w) => $e,
            SocketWire::Tcp($w) => $e,
            SocketWire::Udp($w) => $e,
        }
    };
}

impl Wire for SocketWire {
    async fn send(&mut self, len: usize) -> Result<()> {
        each!(self, w => w.send(len).await)
    }
    async fn recv(&mut self, len: usize) -> Result<()> {
        each!(self, w => w.recv(len).await)
    }
    async fn send_window(&mut self, len: usize, count: u64) -> Result<()> {
        each!(self, w => w.send_window(len, count).await)
    }
    async fn recv_window(&mut self, len: usize, count: u64) -> Result<()> {
        each!(self, w => w.recv_window(len, count).await)
    }
    async fn exchange_window(&mut self, len: usize, count: u64) -> Result<()> {
        each!(self, w => w.exchange_window(len, count).await)
    }
}

/// Set up the requested baselines between rank 0 and rank 1, exchanging
/// their addresses over the fabric on `tag` (sockets on 127.0.0.1 and an
/// abstract Unix name; nothing leaves the machine). Call it on both ranks,
/// with the same arguments, while the fabric is open.
pub async fn connect_baselines(
    fabric: &Fabric,
    tag: Tag,
    which: &[Baseline],
    max_len: usize,
) -> Result<Vec<(Baseline, SocketWire)>> {
    if which.is_empty() {
        return Ok(Vec::new());
    }
    let peer: Rank = 1 - fabric.rank().min(1);
    let ep = fabric.endpoint(peer)?;
    let mut rx = fabric.receiver(tag)?;
    let want = |b| which.contains(&b);
    let (udp, ports) = if want(Baseline::Udp) {
        let (w, p) = UdpWire::bind(max_len).await?;
        (Some(w), p)
    } else {
        (None, [0, 0])
    };
    let (mut out, theirs) = if fabric.rank() == 1 {
        let tcp = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(io("binding the TCP baseline listener"))?;
        let tcp_port = tcp
            .local_addr()
            .map_err(io("reading the TCP listener's address"))?
            .port();
        let name = format!(
            "abtl-perf-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let addr = UnixAddr::from_abstract_name(name.as_bytes())
            .map_err(io("making the Unix baseline's name"))?;
        let ul = std::os::unix::net::UnixListener::bind_addr(&addr)
            .map_err(io("binding the Unix baseline listener"))?;
        ul.set_nonblocking(true)
            .map_err(io("making the Unix listener non-blocking"))?;
        let ul = UnixListener::from_std(ul).map_err(io("registering the Unix listener"))?;
        let msg = format!("{tcp_port} {} {} {name}", ports[0], ports[1]);
        ep.send(tag, msg.into_bytes()).await?;
        let theirs = parse_ports(&rx.recv().await?.data)?;
        let mut out = Vec::new();
        for b in which {
            let w = match b {
                Baseline::Unix => {
                    let (s, _) = ul
                        .accept()
                        .await
                        .map_err(io("accepting the Unix baseline"))?;
                    SocketWire::Unix(UnixWire::unix(s, max_len))
                }
                Baseline::Tcp => {
                    let (s, _) = tcp
                        .accept()
                        .await
                        .map_err(io("accepting the TCP baseline"))?;
                    SocketWire::Tcp(TcpWire::tcp(s, max_len)?)
                }
                // UDP is set up below; Open MPI and UCX are not sockets.
                Baseline::Udp
                | Baseline::Ompi
                | Baseline::OmpiTcp
                | Baseline::Ucx
                | Baseline::UcxTcp
                | Baseline::Ofi => continue,
            };
            out.push((*b, w));
        }
        (out, theirs)
    } else {
        let text = rx.recv().await?.data;
        let text = String::from_utf8_lossy(&text).into_owned();
        let mut it = text.split_whitespace();
        let mut num = || -> Result<u16> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| Error::Misuse(format!("bad baseline address {text:?}")))
        };
        let tcp_port = num()?;
        let theirs = [num()?, num()?];
        let name = text
            .split_whitespace()
            .nth(3)
            .ok_or_else(|| Error::Misuse("baseline address without a Unix name".into()))?
            .to_string();
        let msg = format!("{} {}", ports[0], ports[1]);
        ep.send(tag, msg.into_bytes()).await?;
        let mut out = Vec::new();
        for b in which {
            let w = match b {
                Baseline::Unix => {
                    let addr = UnixAddr::from_abstract_name(name.as_bytes())
                        .map_err(io("making the Unix baseline's name"))?;
                    let s = std::os::unix::net::UnixStream::connect_addr(&addr)
                        .map_err(io("connecting the Unix baseline"))?;
                    s.set_nonblocking(true)
                        .map_err(io("making the Unix stream non-blocking"))?;
                    let s = UnixStream::from_std(s).map_err(io("registering the Unix stream"))?;
                    SocketWire::Unix(UnixWire::unix(s, max_len))
                }
                Baseline::Tcp => {
                    let s = TcpStream::connect(("127.0.0.1", tcp_port))
                        .await
                        .map_err(io("connecting the TCP baseline"))?;
                    SocketWire::Tcp(TcpWire::tcp(s, max_len)?)
                }
                // UDP is set up below; Open MPI and UCX are not sockets.
                Baseline::Udp
                | Baseline::Ompi
                | Baseline::OmpiTcp
                | Baseline::Ucx
                | Baseline::UcxTcp
                | Baseline::Ofi => continue,
            };
            out.push((*b, w));
        }
        (out, theirs)
    };
    if let Some(u) = udp {
        u.connect(theirs).await?;
        out.push((Baseline::Udp, SocketWire::Udp(u)));
    }
    // Keep the report order the caller asked for.
    out.sort_by_key(|(b, _)| which.iter().position(|x| x == b));
    Ok(out)
}

fn parse_ports(b: &[u8]) -> Result<[u16; 2]> {
    let text = String::from_utf8_lossy(b);
    let mut it = text.split_whitespace().map(|v| v.parse::<u16>());
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) => Ok([a, b]),
        _ => Err(Error::Misuse(format!("bad UDP baseline ports {text:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_starts_on_a_page_and_counts_up() {
        for len in [1, 4095, 4096, 16 << 10, (64 << 10) + 3] {
            let p = page_aligned_payload(len);
            assert_eq!(p.len(), len);
            assert_eq!(p.as_ptr() as usize % 4096, 0, "{len} bytes");
            assert!(p.iter().enumerate().all(|(i, b)| *b == i as u8));
        }
    }
}
