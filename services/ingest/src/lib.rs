//! Ingest: streams partner feeds into per-record PATCH commands (DESIGN §2, §8).
#![forbid(unsafe_code)]

pub mod feed;
pub mod item;
