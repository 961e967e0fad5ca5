//! Placeholder until this command lands.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> Result<(), String> {
    Err("this command is not built yet".into())
}
