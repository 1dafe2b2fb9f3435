//! The engine lifecycle: the pure rules (`state`) and the actor that carries them out.

pub mod actor;
pub mod state;

pub use actor::{
    ControlError, EngineRef, Handle, Lease, Refused, Services, Status, ERROR_TAIL_LINES,
};
