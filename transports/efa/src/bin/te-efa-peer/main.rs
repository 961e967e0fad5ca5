//! `te-efa-peer`: a target process for the efa transport's multi-process tests and benchmark.
//!
//! `te-efa-peer serve <bytes> [seed]` exports a pattern-filled buffer of `bytes` using the provider
//! named by `TE_FABRIC_PROVIDER` and serves verification commands on stdin (see `serve.rs`).

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
        _ => Err("usage: te-efa-peer serve <bytes> [seed]".to_string()),
    };
    if let Err(e) = result {
        eprintln!("te-efa-peer: {e}");
        std::process::exit(1);
    }
}
