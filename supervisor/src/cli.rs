//! dsv4d's command line: its options, shared by the daemon and by the packaging step that
//! writes its manual page from them (`packaging/man`).

use std::path::PathBuf;

use clap::Parser;
use dsv4_client::Bus;

/// `--bus`: a bus, or `none` for no control interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusChoice(pub Option<Bus>);

fn parse_bus_choice(s: &str) -> Result<BusChoice, String> {
    match s.trim() {
        "none" => Ok(BusChoice(None)),
        other => other
            .parse::<Bus>()
            .map(|b| BusChoice(Some(b)))
            .map_err(|_| format!("expected system, session or none, not {s:?}")),
    }
}

/// The on-demand supervisor for a local LLM engine (llama-server or ds4-server).
#[derive(Debug, Parser)]
#[command(name = "dsv4d", version, about)]
pub struct Args {
    /// The supervisor configuration file.
    #[arg(long, value_name = "FILE", default_value = "/etc/dsv4/supervisor.yaml")]
    pub config: PathBuf,
    /// Root below which every /sys and /proc file is read (for fixture trees).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub sysroot: PathBuf,
    /// Address to listen on when not socket-activated (overrides api.listen).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Where the control interface lives (D-Bus): system, session, or none to disable it.
    #[arg(long, value_name = "BUS", default_value = "system", value_parser = parse_bus_choice)]
    pub bus: BusChoice,
    /// Check the configuration, print every problem (or a summary), and exit: 0 valid, 1 not.
    #[arg(long)]
    pub check_config: bool,
    /// With --check-config: also print supervisor.yaml with its drop-ins laid over it, each
    /// value with the file and line it comes from.
    #[arg(long, requires = "check_config")]
    pub merged: bool,
    /// Check this machine against what the configuration needs (the files, the GPU's
    /// devices, the engine build, memory, power, the kernel), print the checks as JSON and
    /// exit: 0 when none failed, 1 when one did. `dsv4ctl doctor` runs it as the service
    /// user inside the service's sandbox, and prints the result.
    #[arg(long)]
    pub doctor: bool,
    /// With --doctor: the checks made from the service's place (service), those only the
    /// host shows (host: the kernel and its log), or both (all); box: the service's checks
    /// without this box's worker boxes (what a worker box runs for a coordinator's check).
    #[arg(long, value_name = "PART", default_value = "all", requires = "doctor")]
    pub part: crate::doctor::Part,
    /// With --doctor: read this saved kernel log instead of this boot's journal.
    #[arg(long, value_name = "FILE", requires = "doctor")]
    pub kernel_log: Option<PathBuf>,
    /// Members of this group (and root) may start, stop and switch profiles over D-Bus.
    #[arg(long, value_name = "GROUP", default_value = dsv4_client::CONTROL_GROUP)]
    pub control_group: String,
}
