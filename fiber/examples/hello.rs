//! The "Hello, world!" of fibers: one fiber greets you across three runs.
//!
//! ```text
//! cargo run -p spindle-fiber --example hello -- Ada
//! ```

use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome};

fn say_hello(name: String) -> i32 {
    println!("Hello, {name}!");
    // Suspend; the caller's `run` returns and we continue from here the next
    // time the fiber runs.
    yield_now();
    println!("Welcome back, {name}!");
    yield_now();
    println!("Farewell, {name}!");
    0
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(name), None) = (args.next(), args.next()) else {
        eprintln!("usage: hello <your-name>");
        std::process::exit(64);
    };

    // A 128 KiB stack, named so that panics and overflows say which fiber.
    let fiber = Fiber::new(FiberAttr::new().stack_size(128 * 1024).name("hello"))
        .unwrap_or_else(|e| panic!("creating the fiber failed: {e}"));
    fiber
        .set_function(Priority::HIGHEST, move || say_hello(name))
        .expect("a new fiber takes a function");

    // Each run continues the function until its next suspension point.
    assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(0))));
    assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(0))));
    assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(0))));

    // The function returned: a fourth run is refused, and says why.
    match fiber.run() {
        Err(e) => println!("(a fourth run is refused: {e})"),
        Ok(outcome) => panic!("a finished fiber ran again: {outcome:?}"),
    }

    // The fiber and its stack can be reused for a new function.
    fiber
        .set_function(Priority::HIGHEST, || 0)
        .expect("a finished fiber takes a new function");
}
