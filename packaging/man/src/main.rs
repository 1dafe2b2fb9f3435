//! `dsv4-man`: prints a manual page for `packaging/stage`:
//!
//! - `dsv4-man` (or `dsv4-man dsv4d`): dsv4d(8), made from the daemon's own command-line
//!   definition (`dsv4::cli::Args`);
//! - `dsv4-man supervisor.yaml`: supervisor.yaml(5), made from `docs/configuration.md`, the
//!   configuration's reference, so the two say the same.

mod config_page;

use std::io::Write;
use std::process::ExitCode;

use clap::CommandFactory;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let page = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] | ["dsv4d"] => dsv4d_page(),
        ["supervisor.yaml"] => Ok(config_page::render().into_bytes()),
        _ => {
            eprintln!("usage: dsv4-man [dsv4d | supervisor.yaml]");
            return ExitCode::from(2);
        }
    };
    match page.and_then(|page| std::io::stdout().write_all(&page)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dsv4-man: writing the manual page: {e}");
            ExitCode::FAILURE
        }
    }
}

fn dsv4d_page() -> std::io::Result<Vec<u8>> {
    let mut page = Vec::new();
    let man = clap_mangen::Man::new(dsv4::cli::Args::command()).section("8");
    man.render(&mut page)?;
    Ok(page)
}
