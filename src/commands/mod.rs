//! One module per `bapo` subcommand.

pub mod buffer;
pub mod loss;
