//! `te-bench info`: what is compiled in and whether it runs here. With the efa feature also
//! libfabric's versions (headers at build, library loaded now and from where, or why none loaded:
//! "not available: libfabric.so.1 not found (tried: ...)"), the providers it finds, and what
//! each provider's initiator sees when a request is refused (`RefusalReport`), and libfabric's
//! registration-cache variables. Every transport lists the devices it skipped, with why.

use te_base::SkippedDevice;
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
    let mut rows: Vec<(String, String, Option<String>, Vec<SkippedDevice>)> = engine
        .transports()
        .iter()
        .map(|t| {
            (
                "transport".to_string(),
                t.name.clone(),
                t.unavailable.clone(),
                t.skipped.clone(),
            )
        })
        .collect();
    for p in te_core::device_plugins() {
        rows.push((
            "device-plugin".to_string(),
            p.name.to_string(),
            p.unavailable.clone(),
            Vec::new(),
        ));
    }
    #[cfg(feature = "efa")]
    libfabric(args.json);
    for (kind, name, unavailable, skipped) in rows {
        if args.json {
            print_json(&serde_json::json!({
                "kind": kind, "name": name, "usable": unavailable.is_none(), "reason": unavailable,
                "skipped_devices": skipped,
            }));
        } else {
            match unavailable {
                None => {
                    println!("{kind:14} {name:8} usable");
                    // Devices (NICs, provider domains) the transport serves without, each with why.
                    for d in skipped {
                        println!("  skipped device '{}': {}", d.name, d.reason);
                    }
                }
                // The reason already names every skipped device when none opened.
                Some(r) => println!("{kind:14} {name:8} not available: {r}"),
            }
        }
    }
    Ok(())
}

/// libfabric: the headers the efa transport was compiled against, the library it loaded (path,
/// version, the API version it asks for, the symbol version of fi_getinfo) or why none loaded, the
/// providers with RDM endpoints and RMA, and their refusal reports.
#[cfg(feature = "efa")]
fn libfabric(json: bool) {
    use te_transport_efa::{available_providers, libfabric_versions, RefusalReport};
    let ((hm, hn), _) = libfabric_versions();
    let loaded = te_transport_efa::libfabric();
    let providers = available_providers();
    match (&loaded, json) {
        (Ok(lib), true) => print_json(&serde_json::json!({
            "kind": "libfabric", "header_version": format!("{hm}.{hn}"),
            "runtime_version": format!("{}.{}", lib.version.0, lib.version.1), "path": lib.path,
            "requested": lib.requested, "from_env": lib.from_env,
            "api_version": format!("{}.{}", lib.api_version.0, lib.api_version.1), "abi": lib.abi,
            "providers": providers,
        })),
        (Err(e), true) => print_json(&serde_json::json!({
            "kind": "libfabric", "header_version": format!("{hm}.{hn}"), "runtime_version": null,
            "reason": not_available_reason(e), "providers": providers,
        })),
        (Ok(lib), false) => println!(
            "libfabric      headers {hm}.{hn}, loaded {}.{} from {} (API {}.{}, fi_getinfo@{}); providers: {}",
            lib.version.0,
            lib.version.1,
            lib.path,
            lib.api_version.0,
            lib.api_version.1,
            lib.abi,
            providers.join(", ")
        ),
        (Err(e), false) => println!(
            "libfabric      headers {hm}.{hn}, not available: {}",
            not_available_reason(e)
        ),
    }
    let Ok(lib) = loaded else { return };
    let (rm, rn) = lib.version;
    // libfabric's registration caches, as this process runs with them (te_transport_efa::mr_cache).
    for c in te_transport_efa::mr_cache::settings() {
        let by = if c.set_here {
            "set by the efa transport"
        } else {
            "from the environment"
        };
        if json {
            print_json(&serde_json::json!({
                "kind": "libfabric-mr-cache", "var": c.var, "value": c.value, "set_here": c.set_here,
                "cache_on": c.cache_on,
            }));
        } else {
            let mark = if c.cache_on {
                " WARNING: a registration cache stays on"
            } else {
                ""
            };
            println!("  {}={} ({by}){mark}", c.var, c.value);
        }
    }
    for p in &providers {
        let report = RefusalReport::of(p, (rm, rn));
        if json {
            print_json(&serde_json::json!({
                "kind": "libfabric-provider", "name": p, "refusal": format!("{report:?}"),
                "initiator_learns_of_refusal": report.initiator_learns(), "detail": report.to_string(),
            }));
        } else {
            let mark = if report == RefusalReport::SilentSuccess {
                "WARNING: "
            } else {
                ""
            };
            println!("  {p:14} {mark}{report}");
        }
    }
}

/// The reason of a `NotAvailable` error (the text after "not available: "), else the error.
#[cfg(feature = "efa")]
fn not_available_reason(e: &te_base::Error) -> String {
    match e {
        te_base::Error::NotAvailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}
