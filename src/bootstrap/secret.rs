//! The per-user secret that job keys are derived from when a job is given
//! no `BTL_JOB_KEY`.
//!
//! It is 32 random bytes, written as 64 hex digits in a file only its owner
//! may read: `BTL_SECRET_FILE` when set, else
//! `$XDG_CONFIG_HOME/async-btl/secret`, else `$HOME/.config/async-btl/secret`.
//! The first rank to need it creates it: the bytes go to a fresh file
//! (`O_EXCL`, mode 0600) that is then hard-linked into place, so a rank
//! never reads a half-written secret and two ranks racing to create it end
//! up with the same one (the loser reads the winner's). A file that another
//! user owns, that is not a regular file, or whose mode lets anyone but its
//! owner in, is refused. A home directory shared by the nodes gives every
//! node the same secret.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::RngCore;

use crate::{Error, Result};

/// The variable that names the secret file.
pub(crate) const SECRET_VAR: &str = "BTL_SECRET_FILE";

/// How long a reader waits for a secret that another process is writing in
/// place (only where the file system has no hard links).
const PARTIAL_WAIT: Duration = Duration::from_secs(1);

/// Where the secret lives, from `BTL_SECRET_FILE`, `XDG_CONFIG_HOME` or
/// `HOME` as `get` reports them (relative paths are not used).
///
/// # Errors
/// [`Error::Config`] when none of them gives an absolute path.
pub(crate) fn location(get: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf> {
    let absolute = |name: &str| get(name).map(PathBuf::from).filter(|p| p.is_absolute());
    if let Some(file) = get(SECRET_VAR) {
        let path = PathBuf::from(&file);
        if !path.is_absolute() {
            return Err(Error::Config(format!(
                "{SECRET_VAR}={file:?} must be an absolute path"
            )));
        }
        return Ok(path);
    }
    if let Some(config) = absolute("XDG_CONFIG_HOME") {
        return Ok(config.join("async-btl").join("secret"));
    }
    if let Some(home) = absolute("HOME") {
        return Ok(home.join(".config").join("async-btl").join("secret"));
    }
    Err(Error::Config(format!(
        "no place for the per-user secret that job keys are derived from: neither \
         {SECRET_VAR}, XDG_CONFIG_HOME nor HOME is set to an absolute path"
    )))
}

/// The secret in `path`, created there on first use.
///
/// # Errors
/// [`Error::Config`] naming the file and what to do when it cannot be
/// created or read, belongs to another user, is not a regular file, lets
/// anyone but its owner in, or does not hold 64 hex digits.
pub(crate) fn load_or_create(path: &Path) -> Result<[u8; 32]> {
    match read(path) {
        Ok(Some(secret)) => return Ok(secret),
        Ok(None) => {}
        Err(e) => return Err(e),
    }
    create(path)?;
    match read(path)? {
        Some(secret) => Ok(secret),
        None => Err(trouble(path, "vanished right after it was created")),
    }
}

/// An error about the secret file, with the ways out.
fn trouble(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Config(format!(
        "the per-user secret {} {what}. Job keys are derived from it when BTL_JOB_KEY is not \
         set; set BTL_JOB_KEY (64 hex digits, the same on every rank), or {SECRET_VAR} to a \
         file of your own",
        path.display()
    ))
}

/// Read and check the secret; `Ok(None)` when the file does not exist.
fn read(path: &Path) -> Result<Option<[u8; 32]>> {
    let waited_until = std::time::Instant::now() + PARTIAL_WAIT;
    loop {
        let mut file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(trouble(path, format_args!("cannot be opened: {e}"))),
        };
        let meta = file
            .metadata()
            .map_err(|e| trouble(path, format_args!("cannot be examined: {e}")))?;
        check(path, &meta)?;
        let mut text = String::new();
        (&mut file)
            .take(256)
            .read_to_string(&mut text)
            .map_err(|e| trouble(path, format_args!("cannot be read: {e}")))?;
        let text = text.trim();
        // A file created in place (no hard links) may still be being
        // written by another rank.
        if text.len() < 64 && std::time::Instant::now() < waited_until {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        return match super::JobKey::from_hex(text) {
            Ok(key) => Ok(Some(*key.as_bytes())),
            Err(_) => Err(trouble(
                path,
                "does not hold 64 hex digits; remove it and a new one is made",
            )),
        };
    }
}

/// Owner, kind and mode of an opened secret file.
fn check(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    let me = crate::sys::os::uid();
    if meta.uid() != me {
        return Err(trouble(
            path,
            format_args!(
                "belongs to uid {}, not to this process's uid {me}, so it is not ours to trust",
                meta.uid()
            ),
        ));
    }
    if !meta.is_file() {
        return Err(trouble(path, "is not a regular file"));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(trouble(
            path,
            format_args!(
                "has mode {mode:04o}, which lets others read or change it; make it private \
                 with `chmod 600 {}`",
                path.display()
            ),
        ));
    }
    Ok(())
}

/// Create the secret unless another process just did.
fn create(path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| trouble(path, "has no parent directory"))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| {
            trouble(
                path,
                format_args!("cannot be created ({}: {e})", dir.display()),
            )
        })?;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let text = format!("{}\n", super::JobKey::from_bytes(bytes).to_hex());
    let name = path
        .file_name()
        .map_or_else(|| "secret".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{name}.{}.{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    write_new(&tmp, &text).map_err(|e| trouble(path, format_args!("cannot be created: {e}")))?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {}
        // Another rank was first: its secret is the one.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        // No hard links here: create it in place (readers wait for it).
        Err(_) => match write_new(path, &text) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
            Err(e) => return Err(trouble(path, format_args!("cannot be created: {e}"))),
        },
    }
    tracing::info!(
        path = %path.display(),
        "created the per-user secret that job keys are derived from (mode 0600)"
    );
    Ok(())
}

/// Write `text` to a file that must not exist yet, mode 0600, synced.
fn write_new(path: &Path, text: &str) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "abtl-secret-unit-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn config_msg(r: Result<[u8; 32]>) -> String {
        match r {
            Err(Error::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn created_private_on_first_use_then_reused() {
        let dir = scratch();
        let path = dir.join("sub").join("secret");
        let a = load_or_create(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let sub = std::fs::metadata(dir.join("sub")).unwrap();
        assert_eq!(sub.permissions().mode() & 0o777, 0o700);
        assert_eq!(load_or_create(&path).unwrap(), a);
        // Nothing left beside it.
        assert_eq!(std::fs::read_dir(dir.join("sub")).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn racing_creators_agree() {
        let dir = scratch();
        let path = dir.join("secret");
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let p = path.clone();
                std::thread::spawn(move || load_or_create(&p).unwrap())
            })
            .collect();
        let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(got.iter().all(|s| *s == got[0]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_others_can_read_is_refused_with_the_fix() {
        let dir = scratch();
        let path = dir.join("secret");
        load_or_create(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let msg = config_msg(load_or_create(&path));
        assert!(
            msg.contains("mode 0644") && msg.contains("chmod 600"),
            "{msg}"
        );
        assert!(
            msg.contains("BTL_JOB_KEY") && msg.contains(SECRET_VAR),
            "{msg}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_of_another_user_is_refused() {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to give a file away");
            return;
        }
        let dir = scratch();
        let path = dir.join("secret");
        load_or_create(&path).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        let msg = config_msg(load_or_create(&path));
        assert!(msg.contains("belongs to uid 65534"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn garbage_and_directories_are_refused() {
        let dir = scratch();
        let path = dir.join("secret");
        write_new(&path, &"zz".repeat(32)).unwrap();
        let msg = config_msg(load_or_create(&path));
        assert!(msg.contains("64 hex digits"), "{msg}");
        assert!(!msg.contains("zz"), "the contents are never echoed: {msg}");
        let sub = dir.join("adir");
        std::fs::DirBuilder::new().mode(0o700).create(&sub).unwrap();
        let msg = config_msg(load_or_create(&sub));
        assert!(msg.contains("not a regular file"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn location_prefers_the_variable_then_xdg_then_home() {
        let at = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            location(&move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        };
        let home = [("HOME", "/home/u")];
        assert_eq!(
            at(&home).unwrap(),
            PathBuf::from("/home/u/.config/async-btl/secret")
        );
        let xdg = [("HOME", "/home/u"), ("XDG_CONFIG_HOME", "/cfg")];
        assert_eq!(at(&xdg).unwrap(), PathBuf::from("/cfg/async-btl/secret"));
        let var = [("XDG_CONFIG_HOME", "/cfg"), (SECRET_VAR, "/s/key")];
        assert_eq!(at(&var).unwrap(), PathBuf::from("/s/key"));
        assert!(at(&[(SECRET_VAR, "rel/key")]).is_err());
        assert!(at(&[("HOME", "relative")]).is_err());
        assert!(at(&[]).is_err());
    }
}
