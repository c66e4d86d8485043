//! The whole system on one machine, for `bapo run` and `bapo study`: the
//! services as child processes of this binary over loopback gRPC, followed
//! and summarised, with an HTML report.
//!
//! Imports go one way: `run` (the phases) uses `options`, `supervise` (the
//! child processes), `tail` (following the learner's log), `summary` and
//! `report`; `study` uses `run`. `summary` is a leaf; `report` reads it and
//! `rollouts` (the training rollouts a learner kept); `html` is a leaf.
//! `bench soak` (a feature) starts the services through `supervise` too.

pub mod controlled;
pub mod html;
pub mod options;
pub mod report;
pub mod rollouts;
pub mod run;
pub mod study;
pub mod summary;
pub mod supervise;
pub mod tail;
