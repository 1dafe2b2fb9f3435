//! dsv4-wake: sends one Wake-on-LAN packet from the host's network. Run by
//! `dsv4-wake@INSTANCE.service`, which dsv4d starts through systemd when its own network (the
//! shipped unit's `PrivateNetwork=yes`) reaches no other box.
//!
//!   dsv4-wake MAC/BROADCAST      e.g. dsv4-wake aa:bb:cc:dd:ee:ff/10.77.0.255:9
//!
//! Exit status: 0 sent, 64 refused (not of that shape), 74 the packet could not be sent.

use dsv4::config::Wake;
use dsv4::lifecycle::workers::send_wake_here;

const USAGE: &str = "usage: dsv4-wake MAC/BROADCAST   (e.g. aa:bb:cc:dd:ee:ff/10.77.0.255:9)";
const EXIT_REFUSED: i32 = 64;
const EXIT_SEND_FAILED: i32 = 74;

fn main() {
    std::process::exit(run(std::env::args().skip(1).collect()));
}

fn run(args: Vec<String>) -> i32 {
    let word = match args.as_slice() {
        [flag] if flag == "--help" || flag == "-h" => {
            println!("{USAGE}");
            return 0;
        }
        [word] => word,
        _ => {
            eprintln!("{USAGE}");
            return EXIT_REFUSED;
        }
    };
    let wake = match Wake::from_instance(word) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("dsv4-wake: {e}");
            return EXIT_REFUSED;
        }
    };
    match send_wake_here(&wake) {
        Ok(()) => {
            eprintln!("dsv4-wake: sent the magic packet of {word}");
            0
        }
        Err(e) => {
            eprintln!("dsv4-wake: cannot send to {}: {e}", wake.broadcast);
            EXIT_SEND_FAILED
        }
    }
}
