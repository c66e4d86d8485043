//! Facts several tables of one config file state: the group size
//! (`[actor]`, `[buffer]`), the groups per step (`[learner]`,
//! `[buffer]`), the sampling temperature (`[actor.sampling]`,
//! `[learner]`) and the LoRA rank (`[learner.lora]`, `[actor.vllm]`).
//! `bapo run` sets each from one place; a service started on its own
//! (`bapo actor`, `learner`, `buffer`) reads the same file, so the same
//! rule holds there: a fact the file states in one table is taken by the
//! others, and two tables that state it differently are refused at start,
//! naming both keys. Left alone, such a mismatch shows up only at run
//! time, and quietly: a buffer refusing every group, a learner refusing
//! data at another temperature, adapters an engine cannot load.

use anyhow::bail;

use super::ConfigFile;

/// The value at `path` in the file as written, if it is there.
fn stated<'a>(file: &'a toml::Table, path: &[&str]) -> Option<&'a toml::Value> {
    let (last, tables) = path.split_last()?;
    let mut t = file;
    for name in tables {
        t = t.get(*name)?.as_table()?;
    }
    t.get(*last)
}

/// One fact stated by two keys: which of them the file sets, refused
/// when both are set to different values.
fn which<T: PartialEq + std::fmt::Display>(
    file: &toml::Table,
    a: (&[&str], T),
    b: (&[&str], T),
) -> anyhow::Result<Option<bool>> {
    match (stated(file, a.0).is_some(), stated(file, b.0).is_some()) {
        (true, true) if a.1 != b.1 => bail!(
            "{} = {} and {} = {} state one fact differently: set one (the other follows) or \
             make them equal",
            a.0.join("."),
            a.1,
            b.0.join("."),
            b.1
        ),
        (true, _) => Ok(Some(true)),
        (false, true) => Ok(Some(false)),
        (false, false) => Ok(None),
    }
}

/// Makes the tables of `c` agree on the shared facts as `file` states
/// them; refuses two keys that disagree.
pub fn settle(c: &mut ConfigFile, file: &toml::Table) -> anyhow::Result<()> {
    let group = (c.actor.group_size as u32, c.buffer.group_size);
    match which(
        file,
        (&["actor", "group_size"], group.0),
        (&["buffer", "group_size"], group.1),
    )? {
        Some(true) => c.buffer.group_size = group.0,
        Some(false) => c.actor.group_size = group.1 as usize,
        None => {}
    }
    let batch = (c.learner.batch_groups, c.buffer.batch_groups);
    match which(
        file,
        (&["learner", "batch_groups"], batch.0),
        (&["buffer", "batch_groups"], batch.1),
    )? {
        Some(true) => c.buffer.batch_groups = batch.0,
        Some(false) => c.learner.batch_groups = batch.1,
        None => {}
    }
    let t = (c.actor.sampling.temperature, c.learner.temperature);
    match which(
        file,
        (&["actor", "sampling", "temperature"], t.0),
        (&["learner", "temperature"], t.1),
    )? {
        Some(true) => c.learner.temperature = t.0,
        Some(false) => c.actor.sampling.temperature = t.1,
        None => {}
    }
    // SPEAR's memory fills from groups the learner cannot size alone.
    if c.learner.algo == "spear" {
        let spear = &c.learner.spear;
        spear
            .check_reachable(c.learner.batch_groups, c.actor.group_size)
            .map_err(anyhow::Error::msg)?;
    }
    settle_lora(c, file)
}

/// `[learner.lora]` (its rank, 16 unless stated) and `[actor.vllm]
/// lora_rank`: the learner's table owns the fact.
fn settle_lora(c: &mut ConfigFile, file: &toml::Table) -> anyhow::Result<()> {
    let learner = c.learner.lora.as_ref().map(|l| l.rank);
    let actor_states = stated(file, &["actor", "vllm", "lora_rank"]).is_some();
    match (learner, actor_states) {
        (Some(rank), true) if rank != c.actor.vllm.lora_rank => bail!(
            "learner.lora.rank = {rank} and actor.vllm.lora_rank = {} state one fact \
             differently: leave actor.vllm.lora_rank out (it follows [learner.lora])",
            c.actor.vllm.lora_rank
        ),
        (Some(rank), _) => c.actor.vllm.lora_rank = rank,
        (None, _) => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settled(text: &str) -> anyhow::Result<ConfigFile> {
        ConfigFile::parse(text)
    }

    #[test]
    fn a_fact_stated_once_is_taken_by_the_other_tables() {
        let c = settled("[actor]\ngroup_size = 4\n[learner]\nbatch_groups = 2\n").unwrap();
        assert_eq!((c.buffer.group_size, c.buffer.batch_groups), (4, 2));
        let c = settled("[buffer]\ngroup_size = 6\n").unwrap();
        assert_eq!(c.actor.group_size, 6);
        let c = settled("[learner]\ntemperature = 0.7\n").unwrap();
        assert_eq!(c.actor.sampling.temperature, 0.7);
        let c = settled("[learner.lora]\nrank = 8\n").unwrap();
        assert_eq!(c.actor.vllm.lora_rank, 8);
        let c = settled("[learner.lora]\n").unwrap();
        assert_eq!(c.actor.vllm.lora_rank, 16, "the table's default rank");
    }

    #[test]
    fn two_tables_that_disagree_are_refused_naming_both_keys() {
        for (text, a, b) in [
            (
                "[actor]\ngroup_size = 4\n[buffer]\ngroup_size = 8\n",
                "actor.group_size = 4",
                "buffer.group_size = 8",
            ),
            (
                "[learner]\nbatch_groups = 2\n[buffer]\nbatch_groups = 4\n",
                "learner.batch_groups = 2",
                "buffer.batch_groups = 4",
            ),
            (
                "[actor.sampling]\ntemperature = 1.0\n[learner]\ntemperature = 0.6\n",
                "actor.sampling.temperature = 1",
                "learner.temperature = 0.6",
            ),
            (
                "[learner.lora]\nrank = 8\n[actor.vllm]\nlora_rank = 16\n",
                "learner.lora.rank = 8",
                "actor.vllm.lora_rank = 16",
            ),
        ] {
            let e = format!("{:#}", settled(text).unwrap_err());
            assert!(e.contains(a) && e.contains(b), "{e}");
        }
        // Equal is fine.
        settled("[actor]\ngroup_size = 4\n[buffer]\ngroup_size = 4\n").unwrap();
    }

    #[test]
    fn a_spear_buffer_that_can_never_fill_is_refused() {
        let err = settled(
            "[learner]\nalgo = \"spear\"\nbatch_groups = 2\n[learner.spear]\n\
             trajectory_buffer_size = 64\n[actor]\ngroup_size = 4\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("learner.spear.trajectory_buffer_size = 64"),
            "{err}"
        );
        settled("[learner]\nalgo = \"spear\"\n").unwrap();
    }
}
