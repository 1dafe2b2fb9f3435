//! The engine lifecycle: the pure rules (`state`) and the actor that carries them out.

pub mod state;
