// gather: embedding lookup out[i, :] = table[indices[i], :] (kairos_ir::plan::GatherParams).
// Indices are i64; negative ones count from the end; out-of-range ones give zero rows without
// reading outside the table.

#include "kairos/common.cuh"

struct GatherArgs {
    u64 table, indices, out;
    u32 count, table_rows, cols, rows_per_block;
};
static_assert(sizeof(GatherArgs) == 40, "GatherArgs layout");

template <typename T>
__device__ __forceinline__ void gather_body(const KairosProto& P, const GatherArgs& A) {
    kairos_run(P, [&](u32 b) {
        const u32 i0 = b * A.rows_per_block;
        const u32 i1 = min(i0 + A.rows_per_block, A.count);
        const u64 n = (u64)(i1 - i0) * A.cols;
        for (u64 e = threadIdx.x; e < n; e += blockDim.x) {
            const u32 i = i0 + (u32)(e / A.cols);
            const u32 c = (u32)(e % A.cols);
            i64 idx = ((const i64*)A.indices)[i];
            if (idx < 0) idx += A.table_rows;
            T* out = (T*)A.out + (u64)i * A.cols + c;
            if (idx < 0 || idx >= (i64)A.table_rows) st(out, 0.0f);
            else *out = ((const T*)A.table)[(u64)idx * A.cols + c];
        }
    });
}

KAIROS_KERNELS(gather, GatherArgs, gather_body, 256)
