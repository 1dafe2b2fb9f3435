//! What the machine's state changes while an engine runs: the power settings held and given
//! back (`power`), and the thermal rules with their events (`thermal`).

pub mod power;
pub mod thermal;
