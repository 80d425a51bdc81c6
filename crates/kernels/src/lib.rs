//! kairos-kernels: the kernel library.
//!
//! - [`cpu`]: Rust reference implementations of every kernel a plan can name, block by block with
//!   the same logical-block decomposition as the CUDA kernels. They are the oracle for the CUDA
//!   kernels and the functional half of the simulator.
//! - [`source`]: the CUDA C sources (one protocol header, one file per kernel family), embedded
//!   with `include_str!`, and the mapping from a plan's kernel to its CUDA function and parameter block.

// Unsafe code only where an item says why (allow(unsafe_code) beside its SAFETY contract).
#![deny(unsafe_code)]

pub mod cpu;
pub mod source;
