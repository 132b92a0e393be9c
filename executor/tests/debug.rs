//! `Debug` and `Display` of the executor's public types.

mod common;

use common::watchdog;
use spindle_executor::{Executor, JoinError, SpawnOptions};

#[test]
fn handles_and_errors_say_what_they_are() {
    watchdog("handles_and_errors_say_what_they_are", 30, |_stage| {
        let exec = Executor::builder().workers(1).build();
        let h = exec.spawn_with(SpawnOptions::new().name("answer"), || 42);
        let shown = format!("{h:?}");
        assert!(shown.starts_with("JoinHandle") && shown.contains("\"answer\""), "{shown}");
        assert_eq!(h.join().unwrap(), 42);
        let shown = format!("{exec:?}");
        assert!(shown.contains("spawned: 1") && shown.contains("completed: 1"), "{shown}");
        assert!(format!("{:?}", exec.handle()).starts_with("Handle"));
        exec.scope(|s| {
            let h = s.spawn(|| 1);
            assert!(format!("{h:?}").starts_with("ScopedJoinHandle(JoinHandle"), "{h:?}");
            h.join().unwrap();
        });

        let not_started = JoinError::Cancelled { fiber: None, name: None };
        assert_eq!(not_started.to_string(), "a fiber that had not started was cancelled before it finished (by a cancel on its handle, or by the executor's shutdown)");
        let named = JoinError::Cancelled { fiber: None, name: Some("job".into()) };
        assert_eq!(named.to_string(), "fiber 'job' (not started) was cancelled before it finished (by a cancel on its handle, or by the executor's shutdown)");
        assert_eq!(format!("{named:?}"), format!("Cancelled: {named}"), "the variant, then the message");
        let panicked = exec
            .spawn_with(SpawnOptions::new().name("panicker"), || -> u32 { panic!("oops") })
            .join()
            .expect_err("it panicked");
        let shown = format!("{panicked:?}");
        assert!(shown.starts_with("Panicked: fiber 'panicker'") && shown.ends_with("oops"), "{shown}");
    });
}
