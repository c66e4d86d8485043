//! `bapo eval`: held-out accuracy of a model, greedy and pass@k
//! ([`crate::evaluation`]).

pub use crate::evaluation::EvalArgs;
use crate::evaluation::eval;

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let r = eval(&args)?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}
