//! `te-efa-peer`: a target process for the efa transport's multi-process tests and benchmark.
//!
//! - `te-efa-peer serve <bytes> [seed]` exports a pattern-filled buffer of `bytes` using the
//!   provider named by `TE_FABRIC_PROVIDER` and serves verification commands on stdin (`serve.rs`).
//! - `te-efa-peer client <bytes> <seed>` reads a target's descriptor on stdin, writes and reads
//!   back `bytes` and reports mismatches (`client.rs`); the network-namespace test runs it.
//! - `te-efa-peer client-notify <bytes> <seed> <count>` writes `bytes` to a target in `count`
//!   batches, each followed by a notification naming the range it wrote.
//! - `te-efa-peer bench [options]` measures write bandwidth against a target it starts itself,
//!   with libfabric's and UCX's own tools as same-run baselines (`bench.rs`).

const USAGE: &str = "usage: te-efa-peer serve <bytes> [seed] | client <bytes> <seed> | \
client-notify <bytes> <seed> <count> | bench [--provider P] \
[--total BYTES] [--block BYTES] [--runs N] [--op write|read] [--no-baselines]";

mod bench;
mod client;
mod pattern;
mod serve;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["serve", bytes, rest @ ..] => {
            let seed = rest.first().map_or(Ok(1), |s| s.parse::<u64>());
            match (te_base::config::parse_byte_size(bytes), seed) {
                (Ok(b), Ok(s)) if b > 0 => serve::serve(b as usize, s),
                _ => Err(format!("bad arguments {args:?}: expected serve <bytes> [seed]")),
            }
        }
        ["client", bytes, seed] => match (te_base::config::parse_byte_size(bytes), seed.parse::<u64>()) {
            (Ok(b), Ok(s)) if b > 0 => client::run(b as usize, s),
            _ => Err(format!("bad arguments {args:?}: expected client <bytes> <seed>")),
        },
        ["client-notify", bytes, seed, count] => match (
            te_base::config::parse_byte_size(bytes),
            seed.parse::<u64>(),
            count.parse::<u64>(),
        ) {
            (Ok(b), Ok(s), Ok(c)) if b > 0 && c > 0 => client::run_notified(b as usize, s, c),
            _ => Err(format!(
                "bad arguments {args:?}: expected client-notify <bytes> <seed> <count>"
            )),
        },
        ["bench", rest @ ..] => bench::run(rest),
        _ => Err(USAGE.to_string()),
    };
    if let Err(e) = result {
        eprintln!("te-efa-peer: {e}");
        std::process::exit(1);
    }
}
