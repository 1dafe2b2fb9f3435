//! dsv4-sysfs: the one privileged step of dsv4's power policy. Run as root by
//! `dsv4-sysfs@INSTANCE.service`, which dsv4d starts through systemd when it may not write a
//! file itself; it writes one value to one file, and only a value the kernel lists for it.
//!
//!   dsv4-sysfs [--sysroot DIR] KIND:NAME:VALUE
//!
//! KIND:NAME:VALUE is `gpu:cardN:LEVEL` (an AMD card's power_dpm_force_performance_level),
//! `governor:policyN:GOVERNOR` or `epp:policyN:PREFERENCE` (a cpufreq policy's
//! scaling_governor or energy_performance_preference). Exit status: 0 written, 64 refused
//! (a request of another shape, or a value the machine does not list), 74 the write failed.

use dsv4::host::sysroot::SysRoot;
use dsv4::policy::power::sysfs::{Request, EXIT_REFUSED, EXIT_WRITE_FAILED};

const USAGE: &str = "usage: dsv4-sysfs [--sysroot DIR] KIND:NAME:VALUE\n  \
    gpu:cardN:LEVEL | governor:policyN:GOVERNOR | epp:policyN:PREFERENCE";

fn main() {
    std::process::exit(run(std::env::args().skip(1).collect()));
}

fn run(args: Vec<String>) -> i32 {
    let (root, instance) = match args.as_slice() {
        [flag] if flag == "--help" || flag == "-h" => {
            println!("{USAGE}");
            return 0;
        }
        [instance] => (SysRoot::default(), instance),
        [flag, dir, instance] if flag == "--sysroot" => match SysRoot::new(dir) {
            Ok(root) => (root, instance),
            Err(e) => {
                eprintln!("dsv4-sysfs: {e}");
                return EXIT_REFUSED;
            }
        },
        _ => {
            eprintln!("{USAGE}");
            return EXIT_REFUSED;
        }
    };
    let req = match Request::parse(instance) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dsv4-sysfs: {e}");
            return EXIT_REFUSED;
        }
    };
    if let Err(e) = req.check(&root) {
        eprintln!("dsv4-sysfs: refused {instance}: {e}");
        return EXIT_REFUSED;
    }
    let path = root.path(&req.file());
    match req.write_direct(&root) {
        Ok(()) => {
            println!("dsv4-sysfs: wrote {} to {}", req.value, path.display());
            0
        }
        Err(e) => {
            eprintln!(
                "dsv4-sysfs: writing {} to {}: {e}",
                req.value,
                path.display()
            );
            EXIT_WRITE_FAILED
        }
    }
}
