//! The actor's "stopping" flag (SIGTERM: no new groups): read without
//! waiting by the generation slots, awaited without polling by whatever
//! is blocked on the buffer (a lease request, a wait for weights).

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct StopFlag {
    set: AtomicBool,
    notify: Notify,
}

impl StopFlag {
    pub fn new() -> Self {
        Self::default()
    }

    /// Raises the flag and wakes every waiter.
    pub fn set(&self) {
        self.set.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// Returns once the flag is raised (at once if it is already).
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a `set` between the check and
            // the await still wakes this waiter.
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::*;

    #[tokio::test]
    async fn a_waiter_wakes_when_the_flag_is_raised_and_not_before() {
        let flag = Arc::new(StopFlag::new());
        let waiter = tokio::spawn({
            let flag = flag.clone();
            async move { flag.wait().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "woke before the flag was raised");
        flag.set();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .unwrap();
        // Already raised: returns at once.
        tokio::time::timeout(Duration::from_millis(100), flag.wait())
            .await
            .expect("no wait once raised");
    }
}
