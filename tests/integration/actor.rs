//! actor tests: below
