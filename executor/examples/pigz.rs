//! Parallel gzip in the style of pigz, on the executor.
//!
//! The input is cut into independent blocks (128 KiB by default); each is
//! compressed by its own fiber into a complete gzip member, and the members
//! are written in input order. A concatenation of gzip members is a valid
//! gzip file: `gzip -d` restores the concatenated blocks, i.e. the input.
//! At most `8 x workers` blocks are in flight, so memory stays bounded
//! whatever the size of the input: the main thread reads a block, spawns its
//! fiber, and once the window is full joins the oldest one and writes it.
//!
//! ```text
//! cargo run --release -p spindle-executor --example pigz -- FILE -o FILE.gz
//! cargo run --release -p spindle-executor --example pigz -- --compare [FILE]
//! cargo run --release -p spindle-executor --example pigz -- --self-test
//! ```
//!
//! `--compare` compresses one input held in memory three ways in the same
//! run, with the same blocks and level: the executor (this pipeline), N std
//! threads taking blocks from a shared atomic index, and rayon. It checks
//! that the three outputs are identical and decompress to the input.
//! Without a file it uses 64 MiB of generated, compressible text.
//!
//! `--self-test` checks round trips over edge cases (empty input, a partial
//! block, exact multiples of the block size, many more blocks than the
//! window) and exits non-zero on any mismatch.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{self, BufWriter, IsTerminal, Read, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;
use rayon::prelude::*;
use spindle_executor::{Executor, Handle, JoinHandle};

const USAGE: &str = "\
usage: pigz [OPTIONS] INPUT [-o OUTPUT]
       pigz --compare [OPTIONS] [INPUT]
       pigz --self-test [-w N]

Compresses INPUT (a path, or - for standard input) into a gzip file made of
one member per block, compressed in parallel by fibers of the executor.
Writes to standard output unless -o is given. Prints the throughput (input
bytes / wall time) to standard error.

options:
  -l, --level N        compression level 0-9 (default 6)
  -b, --block-size K   block size in KiB, 1-65536 (default 128)
  -w, --workers N      executor workers, and threads for --compare
                       (default: available cores)
  -o, --output FILE    write the compressed data to FILE
      --compare        compress the same input three ways (executor, std
                       threads, rayon) and print throughput and ratios
      --size MIB       --compare without INPUT: MiB of generated text (default 64)
      --rounds N       --compare: rounds to take the median of (default 3)
      --self-test      check round trips on generated data; non-zero exit on failure
  -h, --help           print this help";

/// Blocks in flight per worker.
const WINDOW_PER_WORKER: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Compress,
    Compare,
    SelfTest,
}

#[derive(Debug)]
struct Options {
    mode: Mode,
    level: u32,
    block_size: usize,
    workers: usize,
    output: Option<String>,
    input: Option<String>,
    size_mib: usize,
    rounds: usize,
}

/// A command-line mistake: reported with the usage text, exit status 2.
struct UsageError(String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn parse_number(flag: &str, value: &str, min: usize, max: usize) -> Result<usize, UsageError> {
    match value.parse::<usize>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(UsageError(format!("{flag} expects a whole number from {min} to {max}, got {value:?}"))),
    }
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Option<Options>, UsageError> {
    let mut opts = Options {
        mode: Mode::Compress,
        level: 6,
        block_size: 128 * 1024,
        workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
        output: None,
        input: None,
        size_mib: 64,
        rounds: 3,
    };
    let mut args = args.into_iter();
    let mut only_positional = false;
    while let Some(arg) = args.next() {
        if only_positional || arg == "-" || !arg.starts_with('-') {
            if let Some(first) = &opts.input {
                return Err(UsageError(format!("more than one input: {first:?} and {arg:?}")));
            }
            opts.input = Some(arg);
            continue;
        }
        if arg == "--" {
            only_positional = true;
            continue;
        }
        // `--flag=value`, `-xVALUE`, or the value in the next argument.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if arg.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ if !arg.starts_with("--") && arg.len() > 2 && arg.is_char_boundary(2) => {
                (arg[..2].to_string(), Some(arg[2..].to_string()))
            }
            _ => (arg.clone(), None),
        };
        let takes_value =
            matches!(flag.as_str(), "-l" | "--level" | "-b" | "--block-size" | "-w" | "--workers")
                || matches!(flag.as_str(), "-o" | "--output" | "--size" | "--rounds");
        let value = if takes_value {
            match inline {
                Some(v) => v,
                None => args.next().ok_or_else(|| UsageError(format!("{flag} needs a value")))?,
            }
        } else if inline.is_some() {
            return Err(UsageError(format!("unknown option {arg:?}")));
        } else {
            String::new()
        };
        match flag.as_str() {
            "-l" | "--level" => opts.level = parse_number(&flag, &value, 0, 9)? as u32,
            "-b" | "--block-size" => opts.block_size = parse_number(&flag, &value, 1, 65536)? * 1024,
            "-w" | "--workers" => opts.workers = parse_number(&flag, &value, 1, 1024)?,
            "-o" | "--output" if value.is_empty() => {
                return Err(UsageError(format!("{flag} needs a file name")))
            }
            "-o" | "--output" => opts.output = Some(value),
            "--size" => opts.size_mib = parse_number(&flag, &value, 1, 16384)?,
            "--rounds" => opts.rounds = parse_number(&flag, &value, 1, 100)?,
            "--compare" => opts.mode = Mode::Compare,
            "--self-test" => opts.mode = Mode::SelfTest,
            "-h" | "--help" => return Ok(None),
            _ => return Err(UsageError(format!("unknown option {arg:?}"))),
        }
    }
    match opts.mode {
        Mode::Compress if opts.input.is_none() => {
            return Err(UsageError("no input given (a path, or - for standard input)".into()))
        }
        Mode::Compare | Mode::SelfTest if opts.output.is_some() => {
            return Err(UsageError("-o is for compressing, not for --compare or --self-test".into()))
        }
        Mode::SelfTest if opts.input.is_some() => {
            return Err(UsageError("--self-test uses generated data and takes no input".into()))
        }
        _ => {}
    }
    Ok(Some(opts))
}

/// Compresses one block into a complete gzip member.
fn gzip_block(data: &[u8], level: u32) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::with_capacity(data.len() / 2 + 64), Compression::new(level));
    enc.write_all(data).expect("writing to a Vec cannot fail");
    enc.finish().expect("writing to a Vec cannot fail")
}

/// Reads up to `size` bytes, fewer only at the end of the input.
fn read_block(input: &mut impl Read, size: usize) -> io::Result<Vec<u8>> {
    let mut block = Vec::with_capacity(size);
    input.take(size as u64).read_to_end(&mut block)?;
    Ok(block)
}

#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    input: u64,
    output: u64,
}

/// The pipeline: reads blocks, compresses each on a fiber, writes the
/// members in order, with at most `window` blocks in flight. An empty
/// input still gets one (empty) member, so the output is a gzip file.
fn compress_stream(
    exec: &Handle,
    mut input: impl Read,
    output: &mut impl Write,
    level: u32,
    block_size: usize,
    window: usize,
) -> io::Result<Totals> {
    fn write_oldest(
        pending: &mut VecDeque<JoinHandle<Vec<u8>>>,
        output: &mut impl Write,
        totals: &mut Totals,
    ) -> io::Result<()> {
        let handle = pending.pop_front().expect("a block in flight");
        let member = handle.join().map_err(|e| io::Error::other(format!("compressing a block: {e}")))?;
        output.write_all(&member)?;
        totals.output += member.len() as u64;
        Ok(())
    }

    let window = window.max(1);
    let mut pending = VecDeque::with_capacity(window);
    let mut totals = Totals::default();
    loop {
        let block = read_block(&mut input, block_size)?;
        if block.is_empty() && totals.input > 0 {
            break;
        }
        let last = block.len() < block_size;
        totals.input += block.len() as u64;
        if pending.len() == window {
            write_oldest(&mut pending, output, &mut totals)?;
        }
        pending.push_back(exec.spawn(move || gzip_block(&block, level)));
        if last {
            break;
        }
    }
    while !pending.is_empty() {
        write_oldest(&mut pending, output, &mut totals)?;
    }
    output.flush()?;
    Ok(totals)
}

/// The blocks of an in-memory input; one empty block for an empty input.
fn blocks_of(data: &[u8], block_size: usize) -> Vec<&[u8]> {
    if data.is_empty() {
        vec![data]
    } else {
        data.chunks(block_size).collect()
    }
}

fn concat(parts: impl IntoIterator<Item = Vec<u8>>) -> Vec<u8> {
    let parts: Vec<Vec<u8>> = parts.into_iter().collect();
    let mut out = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for p in parts {
        out.extend_from_slice(&p);
    }
    out
}

/// The executor pipeline over an in-memory input.
fn compress_spindle(exec: &Executor, workers: usize, data: &[u8], level: u32, block_size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() / 2);
    compress_stream(&exec.handle(), data, &mut out, level, block_size, WINDOW_PER_WORKER * workers)
        .expect("compressing in memory");
    out
}

/// `threads` std threads, each taking the next block from a shared index.
fn compress_threads(threads: usize, data: &[u8], level: u32, block_size: usize) -> Vec<u8> {
    let blocks = blocks_of(data, block_size);
    let next = AtomicUsize::new(0);
    let slots: Vec<OnceLock<Vec<u8>>> = blocks.iter().map(|_| OnceLock::new()).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(block) = blocks.get(i) else { break };
                let _ = slots[i].set(gzip_block(block, level));
            });
        }
    });
    concat(slots.into_iter().map(|s| s.into_inner().expect("every block compressed")))
}

/// Rayon's parallel iterator over the blocks.
fn compress_rayon(pool: &rayon::ThreadPool, data: &[u8], level: u32, block_size: usize) -> Vec<u8> {
    let blocks = blocks_of(data, block_size);
    let parts: Vec<Vec<u8>> = pool.install(|| blocks.par_iter().map(|b| gzip_block(b, level)).collect());
    concat(parts)
}

fn gunzip(data: &[u8]) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    MultiGzDecoder::new(data).read_to_end(&mut out)?;
    Ok(out)
}

/// Deterministic, compressible text resembling prose: 512 made-up words
/// (letters drawn with roughly English frequencies) used with a skewed,
/// roughly Zipf-like frequency, some punctuation, lines of about 72
/// columns; driven by an xorshift generator. Compresses to about 30% at
/// level 6.
fn generate_text(len: usize, seed: u64) -> Vec<u8> {
    const LETTERS: &[u8] = b"eeeeeeettttaaaaoooiiinnnssshhhrrrddllcumwfgypbvkjxqz";
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let words: Vec<Vec<u8>> = (0..512)
        .map(|_| {
            let letters = 1 + next() % 10;
            (0..letters).map(|_| LETTERS[(next() % LETTERS.len() as u64) as usize]).collect()
        })
        .collect();
    let mut out = Vec::with_capacity(len + 64);
    let mut column = 0;
    while out.len() < len {
        let r = next();
        // u^3 for u uniform in [0, 1): small indices are much more frequent.
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        let word = &words[(u * u * u * words.len() as f64) as usize];
        out.extend_from_slice(word);
        column += word.len();
        match r & 31 {
            0 | 1 => out.push(b'.'),
            2 => out.push(b','),
            _ => {}
        }
        if column > 72 {
            out.push(b'\n');
            column = 0;
        } else {
            out.push(b' ');
            column += 1;
        }
    }
    out.truncate(len);
    out
}

fn mb_per_s(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e6
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Fiber stack size. Compressing a block takes 256-320 KiB of stack in
/// unoptimized builds (flate2 builds its compressor state on the stack
/// before boxing it) and 64-96 KiB in optimized ones: the 128 KiB default
/// overflows in the first case. Untouched stack pages cost no memory.
const STACK_SIZE: usize = 512 * 1024;

/// A pool of exactly `workers` workers. Compressing a block is a long
/// CPU-bound stretch without suspension points, which sysmon would take for
/// a stuck worker and answer with more workers than there are cores; the
/// comparison is between equal numbers of threads.
fn build_executor(workers: usize) -> Executor {
    Executor::builder().workers(workers).max_workers(workers).stack_size(STACK_SIZE).build()
}

/// Refuses an output that is the input file itself (another name for it
/// included): creating the output would truncate the input before a byte
/// of it was read.
fn refuse_same_file(input: &File, in_name: &str, out_path: &str) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let inp = input.metadata().map_err(|e| format!("{in_name}: {e}"))?;
    match std::fs::metadata(out_path) {
        Ok(out) if out.dev() == inp.dev() && out.ino() == inp.ino() => Err(format!(
            "{out_path} is the input file {in_name}: writing it would destroy the input; choose another output"
        )),
        _ => Ok(()),
    }
}

fn run_compress(opts: &Options) -> Result<(), String> {
    let name = opts.input.as_deref().expect("checked by parse_args");
    let input: Box<dyn Read> = if name == "-" {
        Box::new(io::stdin().lock())
    } else {
        let file = File::open(name).map_err(|e| format!("{name}: {e}"))?;
        if let Some(path) = &opts.output {
            refuse_same_file(&file, name, path)?;
        }
        Box::new(file)
    };
    let (mut output, out_name): (Box<dyn Write>, &str) = match &opts.output {
        Some(path) => (Box::new(File::create(path).map_err(|e| format!("{path}: {e}"))?), path),
        None if io::stdout().is_terminal() => {
            return Err("refusing to write compressed data to a terminal: use -o FILE or redirect".into())
        }
        None => (Box::new(io::stdout().lock()), "standard output"),
    };
    let mut output = BufWriter::with_capacity(1 << 20, &mut output);
    let exec = build_executor(opts.workers);
    let start = Instant::now();
    let totals = compress_stream(
        &exec.handle(),
        input,
        &mut output,
        opts.level,
        opts.block_size,
        WINDOW_PER_WORKER * opts.workers,
    )
    .map_err(|e| format!("{name} -> {out_name}: {e}"));
    let totals = match totals {
        Ok(t) => t,
        Err(e) => {
            // Leave no partial output behind.
            drop(output);
            if let Some(path) = &opts.output {
                let _ = std::fs::remove_file(path);
            }
            return Err(e);
        }
    };
    let elapsed = start.elapsed();
    drop(output);
    let ratio = if totals.input == 0 { 0.0 } else { 100.0 * totals.output as f64 / totals.input as f64 };
    eprintln!(
        "pigz: {} -> {} bytes ({ratio:.1}%) in {:.3} s: {:.1} MB/s ({} workers, level {}, {} KiB blocks)",
        totals.input,
        totals.output,
        elapsed.as_secs_f64(),
        mb_per_s(totals.input as usize, elapsed),
        opts.workers,
        opts.level,
        opts.block_size / 1024,
    );
    Ok(())
}

fn run_compare(opts: &Options) -> Result<(), String> {
    let (data, source) = match opts.input.as_deref() {
        Some("-") => {
            let mut v = Vec::new();
            io::stdin().lock().read_to_end(&mut v).map_err(|e| format!("standard input: {e}"))?;
            (v, "standard input".to_string())
        }
        Some(path) => (std::fs::read(path).map_err(|e| format!("{path}: {e}"))?, path.to_string()),
        None => (generate_text(opts.size_mib << 20, 1), format!("{} MiB of generated text", opts.size_mib)),
    };
    let (n, level, bs) = (opts.workers, opts.level, opts.block_size);
    let exec = build_executor(n);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .map_err(|e| format!("building the rayon pool: {e}"))?;
    println!(
        "pigz --compare: {source} ({} bytes), level {level}, {} KiB blocks, {n} workers/threads, {} rounds",
        data.len(),
        bs / 1024,
        opts.rounds
    );

    // Warm up: first use maps fiber stacks, starts threads, grows the heap.
    let warm = &data[..data.len().min(8 << 20)];
    let _ = compress_spindle(&exec, n, warm, level, bs);
    let _ = compress_threads(n, warm, level, bs);
    let _ = compress_rayon(&pool, warm, level, bs);

    const NAMES: [&str; 3] = ["spindle executor", "std threads", "rayon"];
    let mut rates: [Vec<f64>; 3] = Default::default();
    let mut reference: Option<Vec<u8>> = None;
    for round in 0..opts.rounds {
        let mut line = format!("round {}:", round + 1);
        // Rotate the order from round to round, so that none always runs first.
        for k in 0..3 {
            let which = (round + k) % 3;
            let start = Instant::now();
            let out = match which {
                0 => compress_spindle(&exec, n, &data, level, bs),
                1 => compress_threads(n, &data, level, bs),
                _ => compress_rayon(&pool, &data, level, bs),
            };
            let elapsed = start.elapsed();
            rates[which].push(mb_per_s(data.len(), elapsed));
            line += &format!("  {} {:.1} MB/s", NAMES[which], mb_per_s(data.len(), elapsed));
            match &reference {
                Some(r) if *r == out => {}
                Some(_) => return Err(format!("{}: output differs from the other methods", NAMES[which])),
                None => reference = Some(out),
            }
        }
        println!("{line}");
    }
    let reference = reference.expect("at least one round");
    let restored = gunzip(&reference).map_err(|e| format!("decompressing: {e}"))?;
    if restored != data {
        return Err("round trip mismatch: decompressed output differs from the input".into());
    }
    let medians: Vec<f64> = rates.iter_mut().map(|r| median(r)).collect();
    println!("median of {} rounds:", opts.rounds);
    for (i, name) in NAMES.iter().enumerate() {
        println!(
            "  {name:<17} {:>7.1} MB/s {:>7.1} MiB/s   {:>5.1}% of std threads   {:>5.1}% of rayon",
            medians[i],
            medians[i] * 1e6 / (1 << 20) as f64,
            100.0 * medians[i] / medians[1],
            100.0 * medians[i] / medians[2],
        );
    }
    println!(
        "compressed: {} bytes ({:.1}% of input); the three outputs are identical and decompress to the input",
        reference.len(),
        100.0 * reference.len() as f64 / data.len().max(1) as f64
    );
    println!("executor: {:?}", exec.stats());
    Ok(())
}

fn run_self_test(opts: &Options) -> Result<(), String> {
    const K: usize = 1024;
    let n = opts.workers;
    let data = generate_text(3 << 20, 7);
    let exec = build_executor(n);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build().map_err(|e| e.to_string())?;
    // (input length, block size, level)
    let cases = [
        (0, 128 * K, 6),
        (1, 128 * K, 6),
        (1000, 128 * K, 1),
        (128 * K, 128 * K, 6),
        (128 * K + 1, 128 * K, 9),
        (300 * K, 64 * K, 0),
        ((1 << 20) + 17, K, 6),
        (3 << 20, 128 * K, 6),
    ];
    for (len, bs, level) in cases {
        let input = &data[..len];
        let what = format!("{len} bytes, {} KiB blocks, level {level}", bs / K);
        // A small window, so that long inputs exercise the sliding window.
        let mut spindle = Vec::new();
        compress_stream(&exec.handle(), input, &mut spindle, level, bs, 2 * n)
            .map_err(|e| format!("{what}: {e}"))?;
        let restored = gunzip(&spindle).map_err(|e| format!("{what}: decompressing: {e}"))?;
        if restored != input {
            return Err(format!("{what}: round trip mismatch ({} bytes back)", restored.len()));
        }
        if spindle != compress_threads(n, input, level, bs) {
            return Err(format!("{what}: std threads output differs"));
        }
        if spindle != compress_rayon(&pool, input, level, bs) {
            return Err(format!("{what}: rayon output differs"));
        }
        println!("ok: {what}: {} bytes compressed", spindle.len());
    }
    check_same_file_refused()?;
    println!("self-test passed: {} cases, and an output that is the input is refused", cases.len());
    Ok(())
}

/// `-o` naming the input file, or a hard link to it, is refused before
/// anything is written, and the input is intact.
fn check_same_file_refused() -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("spindle-pigz-self-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = (|| {
        let input = dir.join("input.txt");
        let link = dir.join("link.txt");
        let text = generate_text(10_000, 3);
        std::fs::write(&input, &text).map_err(|e| e.to_string())?;
        std::fs::hard_link(&input, &link).map_err(|e| e.to_string())?;
        for out in [&input, &link] {
            let args =
                [input.to_string_lossy().into_owned(), "-o".into(), out.to_string_lossy().into_owned()];
            let opts = parse_args(args).map_err(|e| e.0)?.ok_or("the arguments parse to a run")?;
            match run_compress(&opts) {
                Err(e) if e.contains("is the input file") => {}
                other => return Err(format!("-o {} (the input) was not refused: {other:?}", out.display())),
            }
            if std::fs::read(&input).map_err(|e| e.to_string())? != text {
                return Err("the input was changed by a refused run".into());
            }
        }
        println!("ok: an output that is the input (or a hard link to it) is refused");
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn main() -> ExitCode {
    let opts = match parse_args(std::env::args().skip(1)) {
        Ok(Some(opts)) => opts,
        Ok(None) => {
            let _ = writeln!(io::stdout(), "{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("pigz: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match opts.mode {
        Mode::Compress => run_compress(&opts),
        Mode::Compare => run_compare(&opts),
        Mode::SelfTest => run_self_test(&opts),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pigz: {e}");
            ExitCode::FAILURE
        }
    }
}
