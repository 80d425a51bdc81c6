//! The CPU reference executor: runs a plan launch by launch with the reference kernels.

use super::{KernelMemory, run_blocks};
use kairos_core::Tensor;
use kairos_core::plan::{AlignedBytes, BufRef, Plan, Space};

/// The four memory spaces of one request, with the arguments of the launch being run.
pub struct PlanMemory<'a> {
    pub arena: &'a mut [u8],
    pub weights: &'a [u8],
    pub inputs: Vec<&'a [u8]>,
    pub outputs: Vec<&'a mut [u8]>,
    pub args: Vec<BufRef>,
}

impl KernelMemory for PlanMemory<'_> {
    fn arg(&self, i: usize) -> &[u8] {
        let r = self.args[i];
        let o = r.offset_bytes as usize;
        match r.space {
            Space::Arena => &self.arena[o..],
            Space::Weights => &self.weights[o..],
            Space::Input(k) => &self.inputs[k as usize][o..],
            Space::Output(k) => &self.outputs[k as usize][o..],
        }
    }

    fn arg_mut(&mut self, i: usize) -> &mut [u8] {
        let r = self.args[i];
        let o = r.offset_bytes as usize;
        match r.space {
            Space::Arena => &mut self.arena[o..],
            Space::Output(k) => &mut self.outputs[k as usize][o..],
            Space::Weights | Space::Input(_) => panic!("a kernel writes to read-only {:?}", r.space),
        }
    }
}

/// Runs one request through a plan on the CPU and returns its outputs.
pub fn execute_plan(plan: &Plan, inputs: &[Tensor]) -> Result<Vec<Tensor>, String> {
    if inputs.len() != plan.inputs.len() {
        return Err(format!("model '{}' takes {} inputs, got {}", plan.model, plan.inputs.len(), inputs.len()));
    }
    let mut input_bytes = Vec::new();
    for (t, decl) in inputs.iter().zip(&plan.inputs) {
        if t.shape != decl.shape {
            return Err(format!("input '{}' has shape {:?}, the model takes {:?}", decl.name, t.shape, decl.shape));
        }
        input_bytes.push(AlignedBytes::from_slice(&t.cast(decl.dtype).to_bytes()));
    }
    let mut arena = AlignedBytes::zeroed(plan.arena_bytes as usize);
    let mut outputs: Vec<AlignedBytes> = plan.outputs.iter().map(|o| AlignedBytes::zeroed(o.len_bytes() as usize)).collect();
    {
        let mut mem = PlanMemory {
            arena: arena.as_mut_slice(),
            weights: plan.weights.as_slice(),
            inputs: input_bytes.iter().map(|b| b.as_slice()).collect(),
            outputs: outputs.iter_mut().map(|b| b.as_mut_slice()).collect(),
            args: Vec::new(),
        };
        for l in &plan.launches {
            mem.args.clear();
            mem.args.extend_from_slice(&l.args);
            run_blocks(&l.kernel, l.dtype, &mut mem, 0..l.shape.logical_blocks);
        }
    }
    plan.outputs.iter().zip(&outputs).map(|(o, b)| Tensor::from_bytes(o.dtype, o.shape.clone(), b.as_slice())).collect()
}
