//! What a learner's version report means for the buffer, judged by the
//! lineage it carries (the shared type, [`bapo_proto::lineage::Lineage`],
//! checked before it gets here).

pub use bapo_proto::lineage::Lineage;

/// What a version report means for the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportKind {
    /// No lineage in the report: versions only, as before incarnations.
    Legacy,
    /// From the incarnation already current.
    Same,
    /// From an incarnation not seen before: adopt, evict, re-base.
    NewIncarnation,
}

/// Classifies a report's lineage against the current one. `Err` names a
/// zombie: an incarnation the current lineage has superseded (it appears,
/// but not last), or one in `former` (ids that were current here before).
pub fn classify(current: &Lineage, report: &Lineage, former: &[u64]) -> Result<ReportKind, String> {
    let Some(reported) = report.current().map(|i| i.id) else {
        return Ok(ReportKind::Legacy);
    };
    let now = current.current().map(|i| i.id);
    if now == Some(reported) {
        return Ok(ReportKind::Same);
    }
    let superseded =
        current.entries().iter().any(|e| e.id == reported) || former.contains(&reported);
    if superseded {
        return Err(format!(
            "learner incarnation {reported:016x} was superseded by incarnation {:016x} \
             (a learner resumed from a checkpoint); this learner's reports are refused",
            now.unwrap_or(0)
        ));
    }
    Ok(ReportKind::NewIncarnation)
}

#[cfg(test)]
mod tests {
    use bapo_proto::lineage::Incarnation;

    use super::*;

    fn lineage(entries: &[(u64, u64)]) -> Lineage {
        let v = entries
            .iter()
            .map(|&(id, first_version)| Incarnation { id, first_version });
        Lineage::new(v.collect(), 100).unwrap()
    }

    #[test]
    fn reports_are_classified_and_zombies_named() {
        let l = lineage(&[(0xA, 0), (0xB, 50)]);
        assert_eq!(classify(&l, &lineage(&[]), &[]), Ok(ReportKind::Legacy));
        assert_eq!(
            classify(&l, &lineage(&[(0xA, 0), (0xB, 50)]), &[]),
            Ok(ReportKind::Same)
        );
        assert_eq!(
            classify(&l, &lineage(&[(0xA, 0), (0xC, 40)]), &[]),
            Ok(ReportKind::NewIncarnation)
        );
        let zombie = classify(&l, &lineage(&[(0xA, 0)]), &[]).unwrap_err();
        assert!(zombie.contains("000000000000000a"), "{zombie}");
        assert!(zombie.contains("superseded"), "{zombie}");
        assert!(classify(&l, &lineage(&[(0xD, 0)]), &[0xD]).is_err());
        assert_eq!(
            classify(&Lineage::default(), &lineage(&[(0xA, 0)]), &[]),
            Ok(ReportKind::NewIncarnation)
        );
    }
}
