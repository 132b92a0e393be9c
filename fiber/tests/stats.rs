//! Identity and counters: unique ids, names in `Debug`, per-fiber counts.

mod common;

use common::with_watchdog;
use std::collections::HashSet;

use spindle_fiber::{yield_now, yield_value, Fiber, FiberAttr, FiberStats, Priority, RunOutcome};

#[test]
fn runs_and_yields_are_counted() {
    with_watchdog(30, "counters", || {
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        assert_eq!(fiber.stats(), FiberStats::default());
        fiber
            .set_function(Priority::NORMAL, || {
                for i in 0..5 {
                    yield_value(i);
                }
            })
            .unwrap();
        for _ in 0..5 {
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(_)));
        }
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(())));
        let s = fiber.stats();
        assert_eq!((s.runs, s.yields, s.sleeps, s.migrations), (6, 5, 0, 0));

        // Refused runs are not counted.
        assert!(fiber.run().is_err());
        assert_eq!(fiber.stats().runs, 6);

        // Counters accumulate over the fiber's life, across functions.
        fiber.set_function(Priority::NORMAL, yield_now).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(())));
        let s = fiber.stats();
        assert_eq!((s.runs, s.yields), (8, 6));

        // A panic counts its run, not a yield.
        fiber
            .set_function(Priority::NORMAL, || panic!("counted"))
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Panicked(_)));
        let s = fiber.stats();
        assert_eq!((s.runs, s.yields), (9, 6));
    });
}

/// Yields are derived from the other counters (runs that did not sleep or
/// end); a read from inside the fiber does not count its run in progress.
#[test]
fn counters_read_by_the_running_fiber_itself() {
    with_watchdog(30, "counters_inside", || {
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        let me = fiber.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                yield_now();
                yield_now();
                me.stats()
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        let inside = fiber.run().unwrap().unwrap_returned();
        assert_eq!((inside.runs, inside.yields, inside.sleeps), (3, 2, 0));
        let after = fiber.stats();
        assert_eq!((after.runs, after.yields, after.sleeps), (3, 2, 0));
    });
}

#[test]
fn debug_shows_the_name_id_and_state() {
    let fiber = Fiber::<()>::new(FiberAttr::new().name("debug-me").stack_size(64 * 1024)).unwrap();
    let dbg = format!("{fiber:?}");
    assert!(dbg.contains("debug-me"), "{dbg}");
    assert!(dbg.contains(&format!("{:?}", fiber.id())), "{dbg}");
    assert!(dbg.contains("Empty"), "{dbg}");
    assert!(dbg.contains("65536"), "{dbg}");

    let anonymous = Fiber::<()>::new(FiberAttr::new()).unwrap();
    assert!(format!("{anonymous:?}").contains("name: None"), "{anonymous:?}");

    let attr = FiberAttr::new().name("attr-name");
    assert!(format!("{attr:?}").contains("attr-name"), "{attr:?}");

    // A sleeping fiber shows what it waits on and where.
    static GATE: spindle_fiber::WaitReason = spindle_fiber::WaitReason("the debug gate");
    let sleeper = Fiber::<()>::new(FiberAttr::new()).unwrap();
    sleeper
        .set_function(Priority::NORMAL, || spindle_fiber::sleep_on(&GATE))
        .unwrap();
    assert!(matches!(sleeper.run(), Ok(RunOutcome::Slept)));
    let dbg = format!("{sleeper:?}");
    assert!(
        dbg.contains("Sleeping") && dbg.contains("waits_on: the debug gate at "),
        "{dbg}"
    );
    assert!(dbg.contains(file!()), "{dbg}");
}

#[test]
fn names_and_ids() {
    let named = Fiber::<()>::new(FiberAttr::new().name("named")).unwrap();
    assert_eq!(named.name(), Some("named"));
    let unnamed = Fiber::<()>::new(FiberAttr::default()).unwrap();
    assert_eq!(unnamed.name(), None);
    // Display of an id is `#<number>`.
    assert_eq!(named.id().to_string(), format!("#{}", named.id().as_u64()));
    assert_ne!(named.id(), unnamed.id());
}

#[test]
fn ids_are_unique_across_threads() {
    with_watchdog(30, "unique_ids", || {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..500)
                        .map(|_| Fiber::<()>::new(FiberAttr::new()).unwrap().id())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all = HashSet::new();
        for t in threads {
            for id in t.join().unwrap() {
                assert!(all.insert(id), "id {id} given out twice");
            }
        }
        assert_eq!(all.len(), 2000);
    });
}

#[test]
fn priority_can_be_changed() {
    let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    assert_eq!(fiber.priority(), Priority::NORMAL);
    fiber.set_priority(Priority::LOWEST);
    assert_eq!(fiber.priority(), Priority::LOWEST);
    fiber.set_function(Priority::HIGHEST, || ()).unwrap();
    assert_eq!(fiber.priority(), Priority::HIGHEST);
}
