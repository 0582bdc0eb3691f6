//! One module per verb, each the same shape: `Args` (clap derive) and
//! `run(&Context, Args) -> anyhow::Result<()>`. Output goes to stdout,
//! progress and summaries to stderr, so that stdout can be piped.

pub mod gen_feed;
pub mod get;
pub mod import;
pub mod keyframe;
pub mod setup;
pub mod stats;
pub mod tail;
pub mod wait;

/// Stream names and states shared by `setup` and `stats`.
mod streams;
