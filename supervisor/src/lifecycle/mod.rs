//! The engine lifecycle: the pure rules (`state`) and the actor that carries them out, with
//! what the actor owns: the engine's key (`engine_key`), its connections (`upstream`), the
//! leases given without asking it while the engine serves (`gate`), the engines a crashed
//! daemon left (`leftover`), the words of a refusal (`refusal`), the alerts it raises
//! (`alert`), the load under way (`loading`), and a validation matrix cell's settings
//! (`trial`). The KV steps the actor runs are the `kv`
//! subsystem's (`crate::kv::slots`).

pub mod actor;
pub mod alert;
pub mod engine_key;
pub mod engine_ref;
pub mod engine_wire;
pub mod gate;
pub mod holders;
pub mod leftover;
pub mod loading;
pub mod need;
pub mod peer_wire;
pub mod refusal;
pub mod state;
pub mod trial;
pub mod upstream;
pub mod workers;

pub use engine_ref::EngineRef;

pub use actor::{
    ControlError, Handle, Lease, Redactor, Refused, Services, Status, ERROR_TAIL_LINES,
};
