// Utility kernels of the runtime and its measurements (not plan kernels).
//
// kairos_spin: logical block b spins for `ns_per_block` nanoseconds, then adds 1 to counts[b], so a
//   test can see that every block ran exactly once across preemptions and resumes.
// kairos_noop: an empty body under the protocol (what the protocol alone costs).
// kairos_empty: a bare empty kernel (launch cost without the protocol).
// kairos_smmap: a bare kernel whose CTAs spin and record their SM in a bitmap (partition probing).
// kairos_clock: writes %globaltimer to mapped host memory (host/device clock calibration).
// kairos_gpcmap: a bare kernel whose CTAs spin and write their SM to sm_of_cta[blockIdx.x]; launched
//   as thread-block clusters (the CTAs of a cluster run on one GPC), it shows which SMs share a GPC.

#include "kairos/common.cuh"

struct SpinArgs {
    u64 counts;  // u32[total_blocks]
    u64 ns_per_block;
};
static_assert(sizeof(SpinArgs) == 16, "SpinArgs layout");

extern "C" __global__ void kairos_spin(const __grid_constant__ KairosProto P, const __grid_constant__ SpinArgs A) {
    kairos_run(P, [&](u32 b) {
        if (threadIdx.x == 0) {
            const u64 t0 = kairos_globaltimer();
            while (kairos_globaltimer() - t0 < A.ns_per_block) {
            }
            atomicAdd((u32*)A.counts + b, 1u);
        }
        __syncthreads();
    });
}

extern "C" __global__ void kairos_noop(const __grid_constant__ KairosProto P) {
    kairos_run(P, [&](u32) {});
}

extern "C" __global__ void kairos_empty() {}

extern "C" __global__ void kairos_smmap(u32* bitmap, u64 spin_ns) {
    const u64 t0 = kairos_globaltimer();
    while (kairos_globaltimer() - t0 < spin_ns) {
    }
    if (threadIdx.x == 0) {
        const u32 sm = kairos_smid();
        atomicOr(bitmap + sm / 32, 1u << (sm % 32));
    }
}

extern "C" __global__ void kairos_clock(volatile u64* dst) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        dst[1] = kairos_globaltimer();
        __threadfence_system();
        dst[0] = 1;
    }
}

extern "C" __global__ void kairos_gpcmap(u32* sm_of_cta, u64 spin_ns) {
    const u64 t0 = kairos_globaltimer();
    while (kairos_globaltimer() - t0 < spin_ns) {
    }
    if (threadIdx.x == 0) {
        sm_of_cta[blockIdx.x] = kairos_smid();
    }
}
