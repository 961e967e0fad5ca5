//! `te-bench info`: what is compiled in and whether it runs here.

use te_core::TransferEngine;

use crate::util::{print_json, runtime};

#[derive(clap::Args)]
pub struct Args {
    /// One JSON object per transport / plugin.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), String> {
    let rt = runtime()?;
    let engine = rt
        .block_on(
            TransferEngine::builder()
                .segment_name(format!("te-bench-info-{}", std::process::id()))
                .build(),
        )
        .map_err(|e| e.to_string())?;
    let mut rows: Vec<(String, String, Option<String>)> = engine
        .transports()
        .iter()
        .map(|t| ("transport".to_string(), t.name.clone(), t.unavailable.clone()))
        .collect();
    for p in te_core::device_plugins() {
        rows.push(("device-plugin".to_string(), p.name.to_string(), p.unavailable.clone()));
    }
    for (kind, name, unavailable) in rows {
        if args.json {
            print_json(&serde_json::json!({
                "kind": kind, "name": name, "usable": unavailable.is_none(), "reason": unavailable,
            }));
        } else {
            match unavailable {
                None => println!("{kind:14} {name:8} usable"),
                Some(r) => println!("{kind:14} {name:8} not available: {r}"),
            }
        }
    }
    Ok(())
}
