//! The one TOML file every `bapo` command reads: one table per service.
//!
//! ```toml
//! [buffer]
//! listen = "0.0.0.0:50051"
//! max_staleness = 4
//! ```
//!
//! Flags given on the command line override the file.

use std::path::Path;

use anyhow::Context;
use bapo_buffer::BufferConfig;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConfigFile {
    pub buffer: BufferConfig,
}

impl ConfigFile {
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config file {}", path.display()))
    }
}
