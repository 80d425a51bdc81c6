//! Synthetic plans and their profiles for scheduling experiments and tests (the dispatcher's
//! tests, Paella's experiments in kairos-bench), built from the library's ordinary kernels.
//!
//! There is no spin kernel in kairos' library, so a long one-CTA kernel is expressed as a
//! `reduce` with one logical block over a long weight vector: its CTA reads `reduce_len` floats
//! alone, so its duration grows with `reduce_len` on a real GPU (calibrate it with
//! `kairos_bench::paella::calibrate_chain`); on the simulator its duration comes from the
//! profile [`chain_profile`] writes.

use crate::profile::{KernelProfile, ModelProfile};
use kairos_core::DType;
use kairos_core::graph::Act;
use kairos_core::plan::*;
use std::sync::Arc;

/// Threads per CTA of the synthetic kernels (Paella's head-of-line experiment uses 128).
pub const THREADS_PER_CTA: u32 = 128;

/// A job of `kernels` launches in a chain (each depends on the one before), each a single CTA of
/// 128 threads summing `reduce_len` f32 weights: Paella's head-of-line-blocking job.
/// The model has no inputs and one f32 output of one element.
pub fn chain_plan(name: &str, kernels: u32, reduce_len: u32) -> Plan {
    assert!(kernels > 0 && reduce_len > 0);
    let weight_bytes = reduce_len as u64 * 4;
    let mut weights = AlignedBytes::zeroed(weight_bytes as usize);
    for (i, c) in weights.as_mut_slice().chunks_exact_mut(4).enumerate() {
        // Small values so the sum stays finite: 1/1024, 2/1024, ... cycling.
        c.copy_from_slice(&(((i % 1024) as f32) / 1024.0).to_le_bytes());
    }
    let launches = (0..kernels)
        .map(|k| {
            let kernel = Kernel::Reduce(ReduceParams {
                kind: ReduceKind::Sum,
                outer: 1,
                reduce: reduce_len,
                inner: 1,
                elems_per_block: 1,
            });
            let out = if k + 1 == kernels {
                BufRef { space: Space::Output(0), offset_bytes: 0, len_bytes: 4 }
            } else {
                BufRef { space: Space::Arena, offset_bytes: k as u64 * BUFFER_ALIGN_BYTES, len_bytes: 4 }
            };
            Launch {
                name: format!("{name}.spin{k}"),
                kernel,
                dtype: DType::F32,
                shape: LaunchShape {
                    logical_blocks: kernel.logical_blocks(),
                    threads_per_block: THREADS_PER_CTA,
                    shared_mem_bytes: 0,
                },
                args: vec![BufRef { space: Space::Weights, offset_bytes: 0, len_bytes: weight_bytes }, out],
                deps: if k == 0 { vec![] } else { vec![k - 1] },
                layer: None,
                flops: kernel.flops(),
                bytes: kernel.bytes_moved(DType::F32),
            }
        })
        .collect();
    Plan {
        model: name.to_string(),
        dtype: DType::F32,
        inputs: vec![],
        outputs: vec![IoTensor { name: "sum".into(), shape: vec![1], dtype: DType::F32 }],
        launches,
        arena_bytes: kernels as u64 * BUFFER_ALIGN_BYTES,
        weight_bytes,
        layers: vec![],
        weights: Arc::new(weights),
    }
}

/// The shape of one kernel of a [`layered_plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticKernel {
    pub logical_blocks: u32,
    pub threads_per_block: u32,
    pub shared_mem_bytes: u32,
}

/// A model as a chain of element-wise kernels (y = relu(x) ping-ponging between two arena
/// buffers) with the given shapes: one input [n] and one output [n], n = 256 * max blocks.
/// Durations come from a profile (see [`profile_with_durations`]) or the roofline.
pub fn layered_plan(name: &str, kernels: &[SyntheticKernel]) -> Plan {
    assert!(!kernels.is_empty());
    const ELEMS_PER_BLOCK: u32 = 256;
    let max_blocks = kernels.iter().map(|k| k.logical_blocks).max().unwrap();
    let n = (max_blocks * ELEMS_PER_BLOCK) as u64;
    let buf_bytes = (n * 4).next_multiple_of(BUFFER_ALIGN_BYTES);
    let last = kernels.len() - 1;
    let launches = kernels
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let elems = k.logical_blocks * ELEMS_PER_BLOCK;
            let mut shape = [1u32; kairos_core::plan::ELTWISE_RANK_MAX];
            shape[kairos_core::plan::ELTWISE_RANK_MAX - 1] = elems;
            let mut strides = [0u64; kairos_core::plan::ELTWISE_RANK_MAX];
            strides[kairos_core::plan::ELTWISE_RANK_MAX - 1] = 1;
            let kernel = Kernel::Eltwise(EltwiseParams {
                func: EltFunc::Copy,
                act: Act::Relu,
                inputs: 1,
                shape,
                out_strides: strides,
                in_strides: [strides, [0; kairos_core::plan::ELTWISE_RANK_MAX], [0; kairos_core::plan::ELTWISE_RANK_MAX]],
                in_dtypes: [DType::F32; 3],
                out_dtype: DType::F32,
                scalars: [0.0; 2],
                elems_per_block: ELEMS_PER_BLOCK,
            });
            let len = elems as u64 * 4;
            let src = if i == 0 {
                BufRef { space: Space::Input(0), offset_bytes: 0, len_bytes: len }
            } else {
                BufRef { space: Space::Arena, offset_bytes: ((i - 1) % 2) as u64 * buf_bytes, len_bytes: len }
            };
            let dst = if i == last {
                BufRef { space: Space::Output(0), offset_bytes: 0, len_bytes: len }
            } else {
                BufRef { space: Space::Arena, offset_bytes: (i % 2) as u64 * buf_bytes, len_bytes: len }
            };
            Launch {
                name: format!("{name}.k{i}"),
                kernel,
                dtype: DType::F32,
                shape: LaunchShape {
                    logical_blocks: k.logical_blocks,
                    threads_per_block: k.threads_per_block,
                    shared_mem_bytes: k.shared_mem_bytes,
                },
                args: vec![src, dst],
                // Data flow from the previous launch, and the write-after-read hazard on the
                // buffer the one before it read.
                deps: (i.saturating_sub(2)..i).map(|d| d as u32).collect(),
                layer: None,
                flops: kernel.flops(),
                bytes: kernel.bytes_moved(DType::F32),
            }
        })
        .collect();
    Plan {
        model: name.to_string(),
        dtype: DType::F32,
        inputs: vec![IoTensor { name: "x".into(), shape: vec![n as usize], dtype: DType::F32 }],
        outputs: vec![IoTensor { name: "y".into(), shape: vec![n as usize], dtype: DType::F32 }],
        launches,
        arena_bytes: 2 * buf_bytes,
        weight_bytes: 0,
        layers: vec![],
        weights: Arc::new(AlignedBytes::zeroed(0)),
    }
}

/// A profile that gives launch i of `plan` the duration `durations_ns[i]` (for the simulator and
/// the dispatcher's estimates), as if measured on `device` with `sm_count` SMs.
pub fn profile_with_durations(plan: &Plan, durations_ns: &[u64], device: &str, sm_count: u32) -> ModelProfile {
    assert_eq!(plan.launches.len(), durations_ns.len());
    let kernels = plan
        .launches
        .iter()
        .zip(durations_ns)
        .enumerate()
        .map(|(i, (l, &d))| KernelProfile {
            launch: i as u32,
            name: l.name.clone(),
            kernel: l.kernel.name().to_string(),
            duration_ns: d,
            logical_blocks: l.shape.logical_blocks,
            ctas: l.shape.logical_blocks,
            threads_per_cta: l.shape.threads_per_block,
            registers_per_thread: 32,
            shared_mem_bytes: l.shape.shared_mem_bytes,
            ctas_per_sm_max: 0,
            occupancy: 0.0,
            min_sms: 0,
            duration_by_sms: vec![],
        })
        .collect();
    ModelProfile {
        model: plan.model.clone(),
        dtype: plan.dtype,
        batch: 1,
        device: device.to_string(),
        sm_count,
        latency_ns: durations_ns.iter().sum(),
        kernels,
        layers: None,
        placements: None,
    }
}

/// [`chain_plan`]'s profile: every kernel `kernel_ns`.
pub fn chain_profile(plan: &Plan, kernel_ns: u64, device: &str, sm_count: u32) -> ModelProfile {
    profile_with_durations(plan, &vec![kernel_ns; plan.launches.len()], device, sm_count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_plans_are_valid() {
        let p = chain_plan("hol", 8, 1000);
        p.validate().unwrap();
        assert_eq!(p.launches.len(), 8);
        assert!(p.launches.iter().all(|l| l.shape.logical_blocks == 1 && l.shape.threads_per_block == 128));
        assert_eq!(p.launches[7].deps, vec![6]);
        let k = |b| SyntheticKernel { logical_blocks: b, threads_per_block: 256, shared_mem_bytes: 0 };
        let q = layered_plan("l", &[k(10), k(300), k(1), k(40)]);
        q.validate().unwrap();
        assert_eq!(q.launches[3].deps, vec![1, 2]);
        let prof = chain_profile(&p, 300_000, "sim", 132);
        assert_eq!(prof.kernel_time_ns(), 8 * 300_000);
    }
}
