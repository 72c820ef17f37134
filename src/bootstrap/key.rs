//! The job key: a 32-byte secret shared by every rank of one job.
//!
//! It never travels in the clear: the TCP rendezvous proves knowledge of it
//! with HMAC-SHA-256 over fresh nonces, and the directory rendezvous tags each
//! rank's file with an HMAC of its contents.

use std::fmt;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// A 32-byte secret that every rank of a job shares (`BTL_JOB_KEY`, 64 hex
/// characters).
///
/// `Debug` never prints the bytes. Compare keys with [`JobKey::ct_eq`], which
/// takes the same time whatever the contents.
#[derive(Clone)]
pub struct JobKey([u8; 32]);

impl JobKey {
    /// Wrap raw key bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        JobKey(bytes)
    }

    /// The raw key bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A fresh key from the thread-local CSPRNG (seeded by the OS).
    pub fn random() -> Self {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        JobKey(bytes)
    }

    /// Parse 64 hexadecimal characters (either case).
    ///
    /// # Errors
    /// [`Error::Config`] when the text is not exactly 64 hex digits; the
    /// message never repeats the text, which may be a secret.
    pub fn from_hex(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.len() != 64 {
            return Err(Error::Config(format!(
                "a job key must be 64 hex characters, got {} characters: generate one with \
                 `openssl rand -hex 32`",
                text.len()
            )));
        }
        let mut bytes = [0u8; 32];
        for (i, pair) in text.as_bytes().chunks(2).enumerate() {
            let hi = hex_digit(pair[0]);
            let lo = hex_digit(pair[1]);
            match (hi, lo) {
                (Some(hi), Some(lo)) => bytes[i] = hi << 4 | lo,
                _ => {
                    return Err(Error::Config(format!(
                        "a job key must be 64 hex characters; character {} is not a hex digit",
                        2 * i + usize::from(hi.is_some())
                    )))
                }
            }
        }
        Ok(JobKey(bytes))
    }

    /// The key as 64 lower-case hex characters (to hand to child processes).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The key of job `job_id` derived from a secret: HMAC-SHA-256 under
    /// `secret` of the job id. Jobs given no `BTL_JOB_KEY` use the per-user
    /// secret file (see the [bootstrap module](super)); only a process
    /// that can read the secret can compute the key, and each job id gets
    /// a key of its own.
    pub fn for_job(secret: &[u8; 32], job_id: &str) -> Self {
        JobKey(JobKey(*secret).mac(&[b"async-btl job key v2", job_id.as_bytes()]))
    }

    /// Compare two keys in time independent of where they differ.
    pub fn ct_eq(&self, other: &JobKey) -> bool {
        ct_eq(&self.0, &other.0)
    }

    /// HMAC-SHA-256 of `parts` (each length-prefixed, so part boundaries are
    /// unambiguous) under this key.
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        // A key of any length is accepted by HMAC; 32 bytes cannot fail.
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }
}

impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(<redacted>)")
    }
}

/// Equality of two byte strings that does not stop at the first difference.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box keeps the optimiser from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_redacted_debug() {
        let k = JobKey::random();
        let back = JobKey::from_hex(&k.to_hex().to_uppercase()).expect("valid hex");
        assert!(k.ct_eq(&back));
        assert_eq!(format!("{k:?}"), "JobKey(<redacted>)");
    }

    #[test]
    fn bad_hex_is_a_config_error_without_echo() {
        let bad = "zz".repeat(32);
        let err = JobKey::from_hex(&bad).expect_err("not hex");
        assert!(matches!(err, Error::Config(_)));
        assert!(!err.to_string().contains("zz"));
        assert!(JobKey::from_hex("abcd").is_err());
        assert!(JobKey::from_hex(&"é".repeat(32)).is_err());
    }

    #[test]
    fn job_keys_depend_on_job_and_secret() {
        let a = JobKey::for_job(&[1; 32], "job1");
        assert!(a.ct_eq(&JobKey::for_job(&[1; 32], "job1")));
        assert!(!a.ct_eq(&JobKey::for_job(&[1; 32], "job2")));
        assert!(!a.ct_eq(&JobKey::for_job(&[2; 32], "job1")));
    }

    #[test]
    fn mac_separates_parts() {
        let k = JobKey::random();
        assert_ne!(k.mac(&[b"ab", b"c"]), k.mac(&[b"a", b"bc"]));
    }
}
