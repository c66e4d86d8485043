//! Admission of a new group: the rules in order, waiting while the
//! staleness bound holds it, and giving its room back.

use super::*;

impl Inner {
    /// Reserves a place for a new group, waiting while a bound says no.
    pub(super) async fn admit_new_group(&self) -> Result<(), BufferError> {
        let mut held_since: Option<(Instant, Hold)> = None;
        loop {
            if self.closing.load(Relaxed) {
                return Err(BufferError::Closing);
            }
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_admit() {
                Ok(()) => {
                    if let Some((since, why)) = held_since {
                        self.metrics.backpressure[why.index()]
                            .record(since.elapsed().as_secs_f64());
                    }
                    self.metrics.admitted.increment(1);
                    return Ok(());
                }
                Err(Hold::Full) if self.make_room() => continue,
                Err(why) => {
                    held_since.get_or_insert((Instant::now(), why));
                }
            }
            notified.await;
        }
    }

    pub(super) fn try_admit(&self) -> Result<(), Hold> {
        let version = self.version.load(Relaxed);
        let bytes = self.bytes.load(Relaxed);
        let mut l = self.ledger.lock();
        self.admission.check(&View {
            ledger: &l,
            version,
            bytes,
        })?;
        l.held += 1;
        l.inserted += 1;
        Ok(())
    }

    pub(super) fn release_admission(&self) {
        let mut l = self.ledger.lock();
        l.held -= 1;
        l.inserted -= 1;
        drop(l);
        self.changed.notify_waiters();
    }
}
