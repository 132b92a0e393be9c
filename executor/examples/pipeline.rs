//! A word-count pipeline on the executor: channels that close, and a
//! fiber-aware mutex held across a suspension.
//!
//! ```text
//! cargo run --release -p spindle-executor --example pipeline
//! ```
//!
//! A reader fiber sends lines down a channel and closes it when it is done;
//! counter fibers read lines until the channel is closed and empty (`pop`
//! returns `None`) and add their counts to one shared table behind a
//! `spindle_sync::Mutex`, yielding while they hold it (a `std` mutex held
//! across a yield would block every other fiber of the worker that wants
//! it). The main thread joins the counters and prints the most frequent
//! words, then checks the total against a count made on the thread.

use std::collections::HashMap;
use std::sync::Arc;

use spindle_executor::sync::{Channel, Msg, Mutex};
use spindle_executor::{yield_now, Executor};

const COUNTERS: usize = 4;
const LINES: usize = 20_000;

/// The text: a few sentences over and over, with a line number so that
/// lines differ.
fn line(i: usize) -> String {
    const WORDS: [&str; 12] = [
        "fiber", "stack", "yield", "wake", "queue", "worker", "close", "mutex", "channel", "run", "sleep",
        "join",
    ];
    let n = 3 + i % 7;
    let mut s = String::new();
    for k in 0..n {
        s.push_str(WORDS[(i * 7 + k * 5) % WORDS.len()]);
        s.push(' ');
    }
    s.push_str(&format!("line{}", i % 100));
    s
}

fn main() {
    if std::env::args().len() > 1 {
        eprintln!("usage: pipeline (takes no arguments)");
        std::process::exit(2);
    }
    let exec = Executor::new();
    let lines = Arc::new(Channel::<String>::new());
    let table = Arc::new(Mutex::new(HashMap::<String, u64>::new()));

    let reader = {
        let lines = Arc::clone(&lines);
        exec.spawn(move || {
            for i in 0..LINES {
                lines.push(Msg::new(line(i))).expect("open until the reader closes it");
            }
            // The counters take what is queued, then `pop` gives them `None`.
            lines.close();
        })
    };

    let counters: Vec<_> = (0..COUNTERS)
        .map(|_| {
            let (lines, table) = (Arc::clone(&lines), Arc::clone(&table));
            exec.spawn(move || {
                let mut local: HashMap<String, u64> = HashMap::new();
                let mut seen = 0u64;
                while let Some(msg) = lines.pop() {
                    for w in msg.split_whitespace() {
                        *local.entry(w.to_owned()).or_default() += 1;
                    }
                    seen += 1;
                    if seen % 500 == 0 {
                        // Merge, yielding while the lock is held: the other
                        // counters that want it sleep until it is handed on.
                        let mut shared = table.lock();
                        yield_now();
                        for (w, n) in local.drain() {
                            *shared.entry(w).or_default() += n;
                        }
                    }
                }
                let mut shared = table.lock();
                for (w, n) in local.drain() {
                    *shared.entry(w).or_default() += n;
                }
                seen
            })
        })
        .collect();

    reader.join().expect("the reader finished");
    let per_counter: Vec<u64> = counters.into_iter().map(|h| h.join().expect("a counter finished")).collect();
    let table = table.lock();

    let expected: u64 = (0..LINES).map(|i| line(i).split_whitespace().count() as u64).sum();
    let counted: u64 = table.values().sum();
    let mut top: Vec<(&String, &u64)> = table.iter().collect();
    top.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    println!("{LINES} lines, {COUNTERS} counters (lines each: {per_counter:?})");
    for (w, n) in top.iter().take(5) {
        println!("{w:>10} {n}");
    }
    println!("{counted} words counted, {expected} expected");
    assert_eq!(per_counter.iter().sum::<u64>(), LINES as u64, "every line read once");
    assert_eq!(counted, expected, "every word counted once");
}
