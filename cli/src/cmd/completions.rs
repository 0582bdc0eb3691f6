//! `shelfsync completions SHELL`: the shell completion script on stdout,
//! generated from the command line definition (`clap_complete`).

use clap::CommandFactory;
use clap_complete::Shell;

use crate::Cli;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The shell to complete in (bash, zsh, fish, elvish, powershell).
    #[arg(value_enum)]
    shell: Shell,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut cmd = Cli::command();
    let name = cmd.get_name().to_string();
    clap_complete::generate(args.shell, &mut cmd, name, &mut std::io::stdout());
    Ok(())
}
