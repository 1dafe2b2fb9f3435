//! `dsv4-man`: prints dsv4d(8), made from the daemon's own command-line definition
//! (`dsv4::cli::Args`), for `packaging/stage`: `dsv4-man > dsv4d.8`.

use std::io::Write;
use std::process::ExitCode;

use clap::CommandFactory;

fn main() -> ExitCode {
    let mut page = Vec::new();
    let man = clap_mangen::Man::new(dsv4::cli::Args::command()).section("8");
    match man
        .render(&mut page)
        .and_then(|()| std::io::stdout().write_all(&page))
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dsv4-man: writing dsv4d's manual page: {e}");
            ExitCode::FAILURE
        }
    }
}
