//! CPU reference kernels.

use kairos_ir::DType;
use kairos_ir::plan::Kernel;
use std::ops::Range;

/// Memory a kernel runs on: argument `i` of the launch, as bytes from the argument's start to the
/// end of its allocation. Arguments may share an allocation (views into one arena buffer), so a
/// kernel reads what it needs for a block before it writes that block's output.
pub trait KernelMemory {
    fn arg(&self, i: usize) -> &[u8];
    fn arg_mut(&mut self, i: usize) -> &mut [u8];
}

/// Runs logical blocks `blocks` of a kernel.
pub fn run_blocks(kernel: &Kernel, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let _ = (kernel, dtype, mem, blocks);
    unimplemented!("CPU reference kernels land with the foundation issue")
}
