//! Test fixtures other crates' tests share (feature `testing`, which only
//! dev-dependencies turn on): the built-in tiny model with seeded weights.

use burn::prelude::*;

use crate::{ModelConfig, Policy};

/// The `tiny` preset on the CPU backend with weights drawn from `seed`.
pub fn tiny_policy(seed: u64) -> Policy {
    let device = Device::flex();
    device.seed(seed);
    Policy::init(tiny_config(), &device)
}

/// The `tiny` preset's configuration.
pub fn tiny_config() -> ModelConfig {
    ModelConfig::preset("tiny").expect("the tiny preset is built in")
}
