//! Passing file descriptors between processes of one node: Unix
//! `SOCK_SEQPACKET` sockets in the abstract namespace (no file to leave
//! behind), the peer's credentials (`SO_PEERCRED`), and one message with
//! at most one descriptor attached (`SCM_RIGHTS`) each way. Every socket is
//! blocking with send and receive timeouts (which bound `connect` too), so
//! no call here waits longer than the timeout it was given.

use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use socket2::{Domain, SockAddr, Socket, Type};

/// Descriptors one message may carry in; more are closed and refused.
const MAX_FDS: usize = 4;

/// The abstract socket address `name` (no leading NUL: added here).
fn abstract_addr(name: &[u8]) -> std::io::Result<SockAddr> {
    let mut path = Vec::with_capacity(name.len() + 1);
    path.push(0);
    path.extend_from_slice(name);
    SockAddr::unix(Path::new(std::ffi::OsStr::from_bytes(&path)))
}

fn seqpacket() -> std::io::Result<Socket> {
    Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)
}

/// A listening socket bound to abstract name `name`.
pub(crate) fn listen(name: &[u8]) -> std::io::Result<Socket> {
    let s = seqpacket()?;
    s.bind(&abstract_addr(name)?)?;
    s.listen(64)?;
    Ok(s)
}

/// Bound every later send and receive on `s` (and a `connect`) by `limit`.
pub(crate) fn set_timeouts(s: &Socket, limit: Duration) -> std::io::Result<()> {
    s.set_read_timeout(Some(limit))?;
    s.set_write_timeout(Some(limit))
}

/// Connect to the listener at abstract name `name`, every step bounded by
/// `limit` (a full backlog times out; a name nobody listens on is
/// `ConnectionRefused` at once).
pub(crate) fn connect(name: &[u8], limit: Duration) -> std::io::Result<Socket> {
    let s = seqpacket()?;
    set_timeouts(&s, limit)?;
    s.connect(&abstract_addr(name)?)?;
    Ok(s)
}

/// The process on the other end of a connected socket: (pid, uid) as the
/// kernel recorded them when it connected or listened.
pub(crate) fn peer_cred(s: &Socket) -> std::io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes (the size of the
    // `ucred` we pass) into `cred` and the written size into `len`; both
    // live across the call.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::other("SO_PEERCRED returned a short answer"));
    }
    Ok((cred.pid as u32, cred.uid))
}

/// Room for the control message of `n` descriptors, aligned for cmsghdr.
struct Control {
    buf: [u64; 16],
}

impl Control {
    fn space(n: usize) -> usize {
        // SAFETY: CMSG_SPACE is arithmetic on its argument only.
        unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<RawFd>()) as u32) as usize }
    }
}

/// Send `bytes` as one message, with `fd` attached if given.
pub(crate) fn send(s: &Socket, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let mut ctl = Control { buf: [0; 16] };
    // SAFETY: an all-zero msghdr is valid (no name, no buffers, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        msg.msg_control = ctl.buf.as_mut_ptr().cast();
        msg.msg_controllen = Control::space(1) as _;
        // SAFETY: `msg` points at `ctl.buf`, 128 bytes aligned for
        // cmsghdr, of which CMSG_SPACE(one fd) (24 bytes) are claimed, so
        // CMSG_FIRSTHDR is non-null and the header and one RawFd of data
        // it addresses lie inside the buffer.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd.as_raw_fd());
        }
    }
    // SAFETY: `msg` refers to `iov` (over `bytes`, which the kernel only
    // reads) and to `ctl`, all alive across the call.
    let r = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if r as usize != bytes.len() {
        return Err(std::io::Error::other("message sent in part"));
    }
    Ok(())
}

/// What one received message held.
pub(crate) struct Received {
    /// Bytes of the message placed in the buffer.
    pub(crate) len: usize,
    /// The message was longer than the buffer (its rest is lost).
    pub(crate) truncated: bool,
    /// The descriptors that came with it (owned: closed when dropped).
    pub(crate) fds: Vec<OwnedFd>,
    /// More descriptors came than there was room for (those were closed
    /// by the kernel).
    pub(crate) fds_truncated: bool,
}

/// Receive one message into `buf`, with any descriptors attached to it
/// (close-on-exec). A closed connection is a 0-byte message.
pub(crate) fn recv(s: &Socket, buf: &mut [u8]) -> std::io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut ctl = MaybeUninit::<Control>::zeroed();
    // SAFETY: an all-zero msghdr is valid (no name, no buffers, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.as_mut_ptr().cast();
    msg.msg_controllen = Control::space(MAX_FDS) as _;
    debug_assert!(Control::space(MAX_FDS) <= std::mem::size_of::<Control>());
    // SAFETY: `msg` refers to `iov` (over `buf`, writable, `buf.len()`
    // bytes) and to `ctl` (128 bytes, more than the control length
    // claimed), both alive across the call; the kernel writes no more than
    // those lengths.
    let r = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: after recvmsg, `msg.msg_control`/`msg_controllen` describe
    // the control messages the kernel wrote into `ctl`; CMSG_FIRSTHDR and
    // CMSG_NXTHDR only return headers that lie inside that length, and an
    // SCM_RIGHTS message's data holds `(cmsg_len - CMSG_LEN(0)) / 4`
    // descriptors that are new in this process and owned by nobody else,
    // so wrapping each in an OwnedFd (read unaligned) is sound.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let n = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..n {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received {
        len: r as usize,
        truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
        fds,
        fds_truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn name() -> Vec<u8> {
        format!(
            "abtl-test-{}",
            crate::sys::os::hex(&crate::sys::os::random_bytes::<8>())
        )
        .into_bytes()
    }

    #[test]
    fn a_descriptor_and_the_peers_credentials_cross() {
        let n = name();
        let l = listen(&n).unwrap();
        let c = connect(&n, Duration::from_secs(5)).unwrap();
        let (a, _) = l.accept().unwrap();
        let me = (crate::sys::os::pid(), crate::sys::os::uid());
        assert_eq!(peer_cred(&c).unwrap(), me);
        assert_eq!(peer_cred(&a).unwrap(), me);
        let file = std::fs::File::open("/proc/self/status").unwrap();
        send(&a, b"hello", Some(file.as_fd())).unwrap();
        let mut buf = [0u8; 16];
        let got = recv(&c, &mut buf).unwrap();
        assert_eq!(&buf[..got.len], b"hello");
        assert_eq!(got.fds.len(), 1);
        assert!(!got.truncated && !got.fds_truncated);
        // Too long for the buffer: flagged, never silently cut.
        send(&a, &[7u8; 40], None).unwrap();
        let got = recv(&c, &mut buf).unwrap();
        assert!(got.truncated && got.fds.is_empty());
        drop(a);
        assert_eq!(recv(&c, &mut buf).unwrap().len, 0, "closed: 0 bytes");
    }

    #[test]
    fn nobody_listening_is_refused_at_once() {
        let e = connect(&name(), Duration::from_secs(5)).err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    #[test]
    fn a_silent_peer_times_out() {
        let n = name();
        let _l = listen(&n).unwrap();
        let c = connect(&n, Duration::from_millis(50)).unwrap();
        let mut buf = [0u8; 8];
        let e = recv(&c, &mut buf).err().unwrap();
        assert!(matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ));
    }
}
