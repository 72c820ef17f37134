//! Reading settings from environment variables: numbers and switches,
//! with errors that name the variable.

use crate::{Error, Result};

/// An on/off setting: `1`/`on`/`yes`/`true` or `0`/`off`/`no`/`false`.
pub(crate) fn switch(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "yes" | "true" => Some(true),
        "0" | "off" | "no" | "false" => Some(false),
        _ => None,
    }
}

/// A number (or any `FromStr` value) from variable `name`'s value `v`.
pub(crate) fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={v:?} is not a valid number")))
}
