//! `kairos zoo`: list and export the model zoo.

use anyhow::{Context, Result};
use clap::Subcommand;
use kairos_ir::zoo::{ZOO, ZooKind, ZooOptions};
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum ZooCommand {
    /// List the zoo's models.
    List,
    /// Write a zoo model as an ONNX file (random weights from a seed).
    Export {
        name: String,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Sequence length (transformers).
        #[arg(long, default_value_t = kairos_ir::zoo::DEFAULT_SEQ_LEN)]
        seq_len: usize,
        #[arg(long, default_value_t = kairos_ir::zoo::DEFAULT_SEED)]
        seed: u64,
    },
}

pub fn run(cmd: ZooCommand) -> Result<()> {
    match cmd {
        ZooCommand::List => {
            println!("{:<14} {:<22} description", "name", "input");
            for e in ZOO {
                let input = match e.kind {
                    ZooKind::Vision { resolution } => format!("f32 [B,3,{resolution},{resolution}]"),
                    ZooKind::Transformer => "i64 [B,seq] token ids".to_string(),
                };
                println!("{:<14} {:<22} {}", e.name, input, e.description);
            }
            Ok(())
        }
        ZooCommand::Export { name, output, batch, seq_len, seed } => {
            let t = std::time::Instant::now();
            let bytes = kairos_ir::zoo::build(&name, &ZooOptions { batch, seq_len, seed })?;
            std::fs::write(&output, &bytes).with_context(|| format!("cannot write {}", output.display()))?;
            eprintln!("wrote {} ({:.1} MB) in {:.2} s", output.display(), bytes.len() as f64 / 1e6, t.elapsed().as_secs_f64());
            Ok(())
        }
    }
}
