// kairos kernel protocol: the one header every kernel of the library runs under.
//
// A launch has `total_blocks` logical blocks (the decomposition each kernel's parameter struct
// documents in kairos_ir::plan). Its physical CTAs are persistent:
//
//   1. A CTA whose SM (%smid) is outside the launch's SM mask leaves at once.
//   2. Otherwise it reports its placement (its atomic issued beside its first take's, so the two
//      round trips overlap), and loops taking the next logical block with one
//      atomic add on the launch's 64-bit counter word (device memory): the low half counts takes,
//      bit 63 is the launch's stop bit. A take that sees the stop bit, or a count past the end, is
//      no block, and the CTA leaves. Counter values are handed out in order, so the blocks taken
//      are always a prefix [first_block, first_block + taken) of the launch's range: a preempted
//      launch stops at a logical-block boundary, and relaunching with first_block = that boundary
//      runs exactly the blocks never taken. With KAIROS_FLAG_ONE_TAKE (the host knows every CTA
//      lands in the mask and the grid covers the blocks left) a CTA leaves after one block.
//   3. The preempt flag, in one of two places (the host chooses per launch):
//      a. With KAIROS_FLAG_DEVICE_STOP (the default), a word in device memory per launch slot
//         that the host writes with a stream memory operation (cuStreamWriteValue32 on a stream
//         of its own) holding the launch's `seq`. Every take first reads it (one L2 round trip);
//         a CTA that finds its own `seq` there sets the stop bit instead of taking a block. The
//         value is the launch's sequence number, not 1, so a write that lands after its launch
//         ended never stops the slot's next launch, and nothing has to clear the word.
//         Preemption latency: the write's trip through the GPU's front end + the rest of the
//         blocks running when it lands.
//      b. Otherwise a word in mapped pinned host memory (set with one store, no copy). Reading
//         it costs a PCIe round trip (~1.5 us) and such reads serialize across the device, so
//         CTAs do not all poll it: after a take, the CTA that finds the launch's last poll older
//         than `poll_ns` claims the poll (a CAS) and reads the flag. Preemption latency is
//         therefore at most poll_ns + one PCIe read + the longest block.
//      The CTA that finds the flag raised sets the stop bit (atomicOr) and records the count it
//      saw, which is where the launch stops; a host-word poll comes after a take, and its CTA gives
//      that block back when no take came after its own (a CAS from one past it to it with the stop
//      bit), else runs it.
//   4. Stream gate. A launch queued on a stream behind another launch must not run on the
//      partial result of one that was stopped early. Every launch carries a sequence number
//      (`seq`), the sequence number of the launch before it on its stream (`gate_seq`, 0: none)
//      and its stream's gate word (device memory). A launch that ends with blocks never taken
//      writes its `seq` to the gate word; each CTA leader reads the word beside its first take,
//      and a launch that finds its `gate_seq` there stops before any block runs (stop at its
//      first block) and, stopped itself, passes the gate on to the launch behind it. Stream
//      order makes the word final before the next launch's CTAs start: one L2 read, overlapped.
//   5. Overlapped launches (sm_90+, opt-in). The host may launch a kernel as a programmatic
//      dependent of the one before it on its stream, so its CTAs start while that one finishes. Everything
//      up to the first take touches only this launch's own slot and the ring; before the gate
//      read and the first block every thread executes `griddepcontrol.wait` (until the kernel
//      before has completed and its writes are visible; a no-op without such a launch), and a
//      CTA that has run its last block lets the next kernel's CTAs start
//      (`griddepcontrol.launch_dependents`).
//   6. On leaving, a CTA reports completion (blocks run) and counts itself out with one atomic
//      add that also sums the blocks run. The last CTA of the grid to leave restores the slot to
//      zero for the next launch and reports LaunchDone; when the sum says every block ran (the
//      common case) it needs no further read of the slot, and its ring reservation overlaps the
//      reset, so the launch's end costs two L2 round trips after the last block. Otherwise it
//      works out the first block never taken. If no CTA landed inside the mask at all (possible only when the grid
//      is too small to reach every SM of the mask), that last CTA runs the remaining blocks
//      itself wherever it is, so no launch is ever lost; its placement record names its SM.
//   7. Light launches (KAIROS_FLAG_LIGHT), for launches the host never preempts: a grid of one CTA
//      per logical block left (block = first_block + blockIdx.x), no takes, no polls, no mask.
//      A CTA reads the stream gate only when the host says the launch before may have stopped
//      (gate_seq != 0); a closed gate stops the whole launch before any block, and its last CTA
//      out closes the gate behind it (a gated launch always counts its CTAs out, silent never is
//      gated: the host sees to both). The CTA that runs the first block writes the start record (with
//      KAIROS_FLAG_START_RECORD). On leaving, each CTA fences and counts itself out with one
//      atomicInc on the slot's `light_out` word that wraps to zero at the grid's size, so the last
//      CTA out knows it is last and the word is zero again for the next launch with no store and
//      no second fence; that CTA writes the end record. KAIROS_FLAG_SILENT drops the count and the
//      records as well: nothing runs but the kernel's own blocks (and the gate read, if asked).
//
// Notifications are 32-byte records in a ring in mapped pinned host memory that the host polls.
// A launch with KAIROS_FLAG_START_RECORD also reports its start: one placement record with aux 1,
// from the CTA that takes its first block.
// Placement and completion are aggregated per SM: the first CTA of a launch to arrive on an SM
// opens a group, CTAs arriving while it reports join it, and one record carries the group's CTA
// count (the same for completion, with the blocks run). A record is four 8-byte words, each
// holding 4 bytes of payload and the record's sequence number (index + 1); an aligned 8-byte
// store reaches host memory whole (the guarantee NCCL's LL protocol rests on), so the host
// accepts a record when all four words carry the expected sequence number, and no system-wide
// fence is needed on the device. Producers reserve an index with an atomic in device memory and
// never write past what the host has consumed: when the ring is full they wait (backpressure)
// up to `ring_timeout_ns`, then drop the record and raise the ring's overflow word, which the
// host reports as an error. A record is never overwritten unread.
//
//   8. Stop words (KAIROS_FLAG_STOP_WORD), for recorded runs that must stop between kernels. A stop
//      word (KairosStopWord, device memory, one per job slot of the host's) replaces the preempt
//      flag: `preempt_flag` points at it and it is raised when `raised` is nonzero, which the host
//      does with a stream write (and clears with one, in stream order, before the next launch
//      that carries it). A light launch of a run with it (silent; `slot` holds its position in
//      the run + 1) reads the word beside its gate: a CTA that finds it raised runs no block and
//      records the position in `first_skipped` if nothing smaller is there (kernels of a run run
//      in stream order, so the first to skip has the smallest position). The kernel running when
//      the word lands may thus run part of its blocks: the host runs it again whole, which is
//      exact for kernels that never read what they write. A full launch with it (the launch that
//      reports the run's end) stops at every take that finds the word raised, its first take
//      included, and its last CTA out hands `first_skipped` to the host in its end record's CTA
//      field and zeroes it: the run before it stopped at that position (0: it ran whole). A
//      stop at a first take records no block taken (the host runs the launch again from its first
//      block, exact by the same rule). Plain grids (KAIROS_PROTOCOL_OFF, what runs are recorded
//      from by default) read the word the same way when the host sets the flag.
//
// With KAIROS_PROTOCOL_OFF defined the same kernel bodies compile to a plain grid (one CTA per
// logical block, no flag, mask or notifications): the baseline for measuring the protocol's cost.
//
// The Rust mirror of the structs here lives in crates/kernels/src/source.rs; keep them in step.

#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define KAIROS_SM_COUNT_MAX 256
#define KAIROS_NO_BLOCK 0xffffffffu

// Record kinds.
#define KAIROS_REC_PLACED 1u
#define KAIROS_REC_FINISHED 2u
#define KAIROS_REC_DONE 3u

// KairosProto.flags
#define KAIROS_FLAG_NOTIFY 1u
#define KAIROS_FLAG_SM_BITMAP 2u
// The launch writes mapped pinned host memory (zero-copy request outputs): each CTA fences at
// system scope before it counts as done, so the host never sees LaunchDone before the data.
#define KAIROS_FLAG_FENCE_SYSTEM 4u
// Every CTA of the launch lands inside its SM mask and there are at least as many CTAs as
// blocks left: the takes hand out one block per CTA, so a CTA leaves after its first block
// without the take that would only find the range exhausted (one L2 round trip less).
#define KAIROS_FLAG_ONE_TAKE 8u
// No placement or completion records (the host does not track this launch's CTAs): with
// KAIROS_FLAG_NOTIFY the launch reports only its end (KAIROS_REC_DONE).
#define KAIROS_FLAG_NO_CTA_RECORDS 16u
// The launch is a programmatic dependent of the kernel before it on its stream (point 5 above):
// its stream gate may be read only after griddepcontrol.wait. Without it the gate word is final
// when the launch starts, so a CTA reads it beside its first take (one round trip less).
#define KAIROS_FLAG_OVERLAPPED 32u
// Report the launch's start: the CTA whose take hands out the launch's first block writes one
// placement record with aux 1 (its `ctas` field: the grid's CTAs), before it runs that block. With
// KAIROS_FLAG_NO_CTA_RECORDS this makes two records per launch (start and end) whatever its size:
// what kernel-by-kernel dispatch uses to know when a launch left its stream's queue.
#define KAIROS_FLAG_START_RECORD 64u

// A light launch (point 7 above): one CTA per logical block, no takes, no preempt-flag polls, no
// SM mask; it stops only at its stream gate, whole. Cheaper by the round trips that buy exact
// mid-kernel preemption, for launches the host will never preempt.
#define KAIROS_FLAG_LIGHT 128u
// With KAIROS_FLAG_LIGHT: the launch reports nothing and keeps no books (a later launch on its
// stream that reports its end implies this one's; the host infers it from stream order).
#define KAIROS_FLAG_SILENT 256u
// The preempt flag is the device-memory word of point 3a (raised when it holds the launch's seq),
// read at every take; without it, the mapped host word of point 3b, polled.
#define KAIROS_FLAG_DEVICE_STOP 512u
// `preempt_flag` is a stop word (point 8 above).
#define KAIROS_FLAG_STOP_WORD 1024u

// A stop word (point 8), device memory.
struct KairosStopWord {
    u32 raised;         // nonzero: raised (the host writes it)
    u32 first_skipped;  // position + 1 of the first launch of a run that skipped its blocks, or 0
};

// One notification, in mapped pinned host memory: 4 words of (seq << 32 | payload).
//   word 0: kind << 30 | aux << 29 | slot << 19 | sm << 11 | ctas (11 bits)
//   word 1: finished: logical blocks run by the group; done: the first block never taken
//   word 2, 3: %globaltimer when written, low and high halves
struct KairosRecord {
    u64 w[4];
};

// Ring control words in mapped pinned host memory.
struct KairosRingHost {
    u64 consumed;  // records the host has consumed (host writes, device reads)
    u32 overflow;  // set by a producer that had to drop a record (device writes, host reads)
    u32 pad;
};

// Ring control words in device memory.
struct KairosRingDev {
    u64 reserve;  // next record index to hand out
    u64 limit;    // cached consumed + capacity: indices below it may be written without asking the host
};

#define KAIROS_STOP_BIT (1ull << 63)

// Per-launch-slot state in device memory. All zero between launches (the protocol restores that).
struct KairosSlot {
    u64 next;          // low half: takes since first_block; bit 63: stop
    u64 done;          // CTAs that have left << 32 | logical blocks they ran
    u64 last_poll_ns;  // %globaltimer of the last read of the host's preempt flag (0: none yet)
    u32 stop_at;       // takes that were valid when the stop bit was set
    u32 light_out;     // light launches: CTAs counted out, modulo the grid (zero between launches)
    u32 placed[KAIROS_SM_COUNT_MAX];    // per-SM placement group being reported
    u64 finished[KAIROS_SM_COUNT_MAX];  // per-SM completion group: ctas << 32 | blocks
};

// The protocol half of every kernel's parameters (the first kernel parameter, by value).
struct KairosProto {
    u64 slot_state;    // KairosSlot* (device memory)
    u64 preempt_flag;  // volatile u32*: device memory (KAIROS_FLAG_DEVICE_STOP) or mapped pinned host memory
    u64 ring_records;  // KairosRecord* (mapped pinned host memory, device address)
    u64 ring_host;     // KairosRingHost* (mapped pinned host memory, device address)
    u64 ring_dev;      // KairosRingDev* (device memory)
    u64 sm_mask[KAIROS_SM_COUNT_MAX / 64];
    u64 sm_bitmap;     // u32[KAIROS_SM_COUNT_MAX / 32] of SMs that ran blocks (tests), or 0
    u64 ring_timeout_ns;
    u32 slot;
    u32 first_block;
    u32 total_blocks;
    u32 ring_capacity;  // a power of two
    u32 flags;
    u32 poll_ns;        // least interval between reads of the host's preempt flag
    u64 gate_word;      // u32* (device memory): seq of the last launch on this stream that stopped early
    u32 seq;            // this launch's sequence number (never 0)
    u32 gate_seq;       // seq of the launch before this one on its stream, or 0
};

static_assert(sizeof(KairosRecord) == 32, "KairosRecord layout");
static_assert(sizeof(KairosSlot) == 3104, "KairosSlot layout");
static_assert(sizeof(KairosProto) == 128, "KairosProto layout");

__device__ __forceinline__ u32 kairos_smid() {
    u32 r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    return r;
}

__device__ __forceinline__ u64 kairos_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Waits until the kernel before this one on its stream (launched as our programmatic
// prerequisite) has completed and its writes are visible. A no-op otherwise.
__device__ __forceinline__ void kairos_wait_prerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the kernel after this one on its stream start its CTAs (this CTA runs no more blocks).
__device__ __forceinline__ void kairos_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define KAIROS_NO_RECORD 0xffffffffffffffffull

// A ring index reserved by kairos_reserve_begin (idx) with the ring's cached limit read beside it.
struct KairosReservation {
    u64 idx, limit;
};

// Reserves the next record index (called by one thread; only for launches that notify). Nothing
// waits for the answer here: memory operations that do not depend on it may be issued before
// kairos_reserve_end looks at it.
__device__ __forceinline__ KairosReservation kairos_reserve_begin(const KairosProto& P) {
    KairosRingDev* rd = (KairosRingDev*)P.ring_dev;
    KairosReservation r;
    r.idx = atomicAdd(&rd->reserve, 1ull);
    r.limit = *(volatile u64*)&rd->limit;  // issued beside the reservation
    return r;
}

// The reserved index, or KAIROS_NO_RECORD when the ring stayed full past ring_timeout_ns (the
// record is dropped and the overflow word raised). Never hands out an index whose last lap the
// host has not consumed.
__device__ __forceinline__ u64 kairos_reserve_end(const KairosProto& P, KairosReservation r) {
    KairosRingDev* rd = (KairosRingDev*)P.ring_dev;
    const u64 idx = r.idx;
    volatile KairosRingHost* rh = (volatile KairosRingHost*)P.ring_host;
    // Every half ring, the one producer of that index pushes the cached limit ahead from what the
    // host has consumed (one PCIe read), so producers do not all find it exhausted at once: a
    // burst of CTAs ending together at the wrap would each read the host's word over PCIe, and
    // such reads serialize (measured: 100-600 us of stall on a full-grid preemption, 2026-11-28).
    if ((idx & (u64)(P.ring_capacity / 2u - 1u)) == 0ull && idx != 0ull) {
        atomicMax(&rd->limit, rh->consumed + P.ring_capacity);
    }
    if (idx >= r.limit) {
        // Slow path: the ring may be full. Another producer may have refreshed the limit (read it
        // again from device memory first); else ask the host how far it has consumed, and wait.
        u64 t0 = kairos_globaltimer();
        for (;;) {
            if (idx < *(volatile u64*)&rd->limit) break;
            u64 fresh = rh->consumed + P.ring_capacity;
            atomicMax(&rd->limit, fresh);
            if (idx < fresh) break;
            if (kairos_globaltimer() - t0 > P.ring_timeout_ns) {
                rh->overflow = 1;
                __threadfence_system();
                return KAIROS_NO_RECORD;
            }
            __nanosleep(1000);
        }
    }
    return idx;
}

// Reserves the next record of the ring: its index, or KAIROS_NO_RECORD (the launch does not
// notify, or the ring stayed full).
__device__ __forceinline__ u64 kairos_reserve(const KairosProto& P) {
    if (!(P.flags & KAIROS_FLAG_NOTIFY)) return KAIROS_NO_RECORD;
    return kairos_reserve_end(P, kairos_reserve_begin(P));
}

// Writes record `idx` (from kairos_reserve; nothing for KAIROS_NO_RECORD).
__device__ __forceinline__ void kairos_write_record(const KairosProto& P, u64 idx, u32 kind, u32 sm, u32 ctas, u32 blocks,
                                                    u32 aux) {
    if (idx == KAIROS_NO_RECORD) return;
    const u64 seq = (u64)(u32)(idx + 1) << 32;
    const u64 t = kairos_globaltimer();
    volatile u64* r = (volatile u64*)P.ring_records + (idx & (u64)(P.ring_capacity - 1)) * 4;
    r[0] = seq | (kind << 30) | (aux << 29) | ((P.slot & 0x3ffu) << 19) | ((sm & 0xffu) << 11) | min(ctas, 0x7ffu);
    r[1] = seq | blocks;
    r[2] = seq | (u32)t;
    r[3] = seq | (u32)(t >> 32);
}

// Appends one record to the ring (called by one thread). Never overwrites an unconsumed record.
__device__ __forceinline__ void kairos_emit(const KairosProto& P, u32 kind, u32 sm, u32 ctas, u32 blocks, u32 aux) {
    kairos_write_record(P, kairos_reserve(P), kind, sm, ctas, blocks, aux);
}

// Whether the launch reports its CTAs' placement and completion.
__device__ __forceinline__ bool kairos_cta_records(const KairosProto& P) {
    return (P.flags & (KAIROS_FLAG_NOTIFY | KAIROS_FLAG_NO_CTA_RECORDS)) == KAIROS_FLAG_NOTIFY;
}

// Reports one CTA arriving on `sm`, aggregated with the CTAs that arrive while it reports.
__device__ __forceinline__ void kairos_report_placed(const KairosProto& P, KairosSlot* S, u32 sm) {
    if (!kairos_cta_records(P)) return;
    if (atomicAdd(&S->placed[sm], 1u) == 0u) {
        u32 n = atomicExch(&S->placed[sm], 0u);
        kairos_emit(P, KAIROS_REC_PLACED, sm, n, 0, 0);
    }
}

// Reports one CTA leaving `sm` after running `blocks` logical blocks, aggregated likewise.
__device__ __forceinline__ void kairos_report_finished(const KairosProto& P, KairosSlot* S, u32 sm, u32 blocks) {
    if (!kairos_cta_records(P)) return;
    if (atomicAdd(&S->finished[sm], (1ull << 32) | (u64)blocks) == 0ull) {
        u64 v = atomicExch(&S->finished[sm], 0ull);
        kairos_emit(P, KAIROS_REC_FINISHED, sm, (u32)(v >> 32), (u32)v, 0);
    }
}

// Restores a slot to zero for the next launch (the last CTA of a launch, before its LaunchDone).
__device__ __forceinline__ void kairos_reset_slot(KairosSlot* S) {
    S->next = 0;
    S->done = 0;
    S->stop_at = 0;
    S->last_poll_ns = 0;
}

// Sets the launch's stop bit (once) and records how many takes were valid before it.
__device__ __forceinline__ void kairos_stop(KairosSlot* S) {
    u64 old = atomicOr((unsigned long long*)&S->next, KAIROS_STOP_BIT);
    if (!(old & KAIROS_STOP_BIT)) S->stop_at = (u32)old;
}

// Stops a launch whose stream gate is closed (the launch before it stopped early): no block of it
// may run, so it stops at its first block. Every CTA of such a launch finds the gate closed
// before running anything, and none of them polls the host flag, so nothing else writes stop_at.
__device__ __forceinline__ void kairos_stop_at_gate(KairosSlot* S) {
    atomicOr((unsigned long long*)&S->next, KAIROS_STOP_BIT);
    *(volatile u32*)&S->stop_at = 0u;
}

// Whether the launch before this one on its stream stopped early (leader thread only).
__device__ __forceinline__ bool kairos_gate_closed(const KairosProto& P) {
    return P.gate_seq != 0u && *(volatile u32*)P.gate_word == P.gate_seq;
}

// Stops the launch at a take that found the preempt flag raised: when no other take came after
// it (the counter still reads one past it), the take is given back, so the launch stops at that
// block and the CTA runs nothing more; otherwise the take stands (later takes were granted too)
// and the stop comes after them. Returns whether the block was given back.
__device__ __forceinline__ bool kairos_stop_at_take(KairosSlot* S, u64 v) {
    if (atomicCAS((unsigned long long*)&S->next, v + 1ull, v | KAIROS_STOP_BIT) == v + 1ull) {
        S->stop_at = (u32)v;
        return true;
    }
    kairos_stop(S);
    return false;
}

// Whether the device-memory preempt flag is raised (one read): it holds the launch's seq, or it
// is a stop word and nonzero.
__device__ __forceinline__ bool kairos_device_flag_raised(const KairosProto& P) {
    const u32 f = *(volatile u32*)P.preempt_flag;
    return (P.flags & KAIROS_FLAG_STOP_WORD) ? f != 0u : f == P.seq;
}

// Whether the launch's preempt flag is raised (one read; point 3).
__device__ __forceinline__ bool kairos_flag_raised(const KairosProto& P) {
    if (P.flags & KAIROS_FLAG_DEVICE_STOP) return kairos_device_flag_raised(P);
    return *(volatile u32*)P.preempt_flag != 0u;
}

// One take (leader thread only): the next logical block, or KAIROS_NO_BLOCK when the launch is
// exhausted or stopped. A CTA that takes a block also reads the preempt flag: the device word at
// every take, the host word when the launch's last poll is older than poll_ns; neither when
// `gated` (the take of a CTA that still has to check its stream gate, which no stop may race).
__device__ __forceinline__ u32 kairos_take(const KairosProto& P, KairosSlot* S, bool gated = false) {
    if (P.flags & KAIROS_FLAG_DEVICE_STOP) {
        // The flag is read before the take, and a raised flag stops the launch without one: a CTA
        // at a block boundary after the flag landed runs nothing more, so a preemption waits for
        // the blocks running when it lands and no more. (Read beside the take, the flag would
        // stop the launch only after the block that take handed out: CTAs that run in step, as
        // a kernel's tiles do, all take together, so none could give its block back.) The price
        // is one L2 round trip per take that the take's atomic no longer overlaps.
        if (!gated && kairos_device_flag_raised(P)) {
            kairos_stop(S);
            return KAIROS_NO_BLOCK;
        }
        if (gated && (P.flags & KAIROS_FLAG_STOP_WORD) && kairos_device_flag_raised(P)) {
            // A stop word raised before the first take: what the run before this launch left may
            // be partial, so no block of it runs (stopped as at a closed gate: no block taken).
            kairos_stop_at_gate(S);
            return KAIROS_NO_BLOCK;
        }
        const u64 v = atomicAdd((unsigned long long*)&S->next, 1ull);
        const u32 taken = (u32)v;
        if ((v & KAIROS_STOP_BIT) || taken >= P.total_blocks - P.first_block) return KAIROS_NO_BLOCK;
        return P.first_block + taken;
    }
    const u64 v = atomicAdd((unsigned long long*)&S->next, 1ull);
    // The poll clock is read beside the take (both round trips overlap), not after it.
    const u64 last = gated ? 0ull : *(volatile u64*)&S->last_poll_ns;
    const u32 taken = (u32)v;
    if ((v & KAIROS_STOP_BIT) || taken >= P.total_blocks - P.first_block) return KAIROS_NO_BLOCK;
    if (gated) return P.first_block + taken;
    const u64 now = kairos_globaltimer();
    if (last == 0ull) {
        // The first claim of a launch only starts the clock (the host cleared the flag at
        // launch). Nothing waits for the answer: whoever wins, the clock has started.
        atomicCAS((unsigned long long*)&S->last_poll_ns, 0ull, now);
    } else if (now - last >= P.poll_ns && atomicCAS((unsigned long long*)&S->last_poll_ns, last, now) == last) {
        if (*(volatile u32*)P.preempt_flag && kairos_stop_at_take(S, v)) return KAIROS_NO_BLOCK;
    }
    return P.first_block + taken;
}

// The persistent loop: takes logical blocks until none are left or the launch is stopped.
// Returns the blocks this CTA ran (in every thread).
// `report` makes the leader report the CTA's placement too, with its atomic issued beside the
// first take's so the two L2 round trips overlap. `one_take`: see KAIROS_FLAG_ONE_TAKE.
template <typename Body>
__device__ __forceinline__ u32 kairos_take_loop(const KairosProto& P, KairosSlot* S, u32 sm, Body& body, bool report,
                                                bool one_take) {
    __shared__ u32 s_block[2];
    const bool leader = threadIdx.x == 0;
    u32 ran = 0;
    u32 gate_now = 0u;  // the leader's early read of the stream gate (kept in a register: a
                        // shared-memory store of it would hold the take back until it arrives)
    for (u32 it = 0;; ++it) {
        if (leader) {
            // The first take's placement atomic is issued beside it (the round trips overlap);
            // both touch only this launch's slot, so they run before the prerequisite wait.
            const bool gated = it == 0 && P.gate_seq != 0u;
            // Not overlapped: the gate word is final already, so it is read beside the take.
            if (gated && !(P.flags & KAIROS_FLAG_OVERLAPPED)) gate_now = *(volatile u32*)P.gate_word;
            u32 b;
            if (it == 0 && report && kairos_cta_records(P)) {
                const u32 opened = atomicAdd(&S->placed[sm], 1u);
                b = kairos_take(P, S, gated);
                if (opened == 0u) {
                    const u32 n = atomicExch(&S->placed[sm], 0u);
                    kairos_emit(P, KAIROS_REC_PLACED, sm, n, 0, 0);
                }
            } else {
                b = kairos_take(P, S, gated);
            }
            s_block[it & 1] = b;
        }
        if (it == 0) {
            kairos_wait_prerequisite();
            // The stream gate is final once the kernel before has completed (read beside the
            // take when the launch is not overlapped).
            if (leader && P.gate_seq != 0u &&
                ((P.flags & KAIROS_FLAG_OVERLAPPED) ? kairos_gate_closed(P) : gate_now == P.gate_seq)) {
                kairos_stop_at_gate(S);
                s_block[0] = KAIROS_NO_BLOCK;
            }
        }
        __syncthreads();
        const u32 b = s_block[it & 1];
        if (b == KAIROS_NO_BLOCK) break;
        // The launch's first block: report the start (the other warps go on into the block; the
        // record's reservation is one L2 round trip of this warp).
        if (leader && b == P.first_block && (P.flags & (KAIROS_FLAG_NOTIFY | KAIROS_FLAG_START_RECORD)) ==
                                                (KAIROS_FLAG_NOTIFY | KAIROS_FLAG_START_RECORD)) {
            kairos_emit(P, KAIROS_REC_PLACED, sm, min(gridDim.x, 0x7ffu), 0, 1u);
        }
        if (leader && ran == 0 && (P.flags & KAIROS_FLAG_SM_BITMAP)) {
            atomicOr((u32*)P.sm_bitmap + sm / 32, 1u << (sm % 32));
        }
        body(b);
        ++ran;
        if (one_take) break;
    }
    return ran;
}

// A light launch (point 7): one CTA per logical block, no takes.
template <typename Body>
__device__ __forceinline__ void kairos_run_light(const KairosProto& P, Body body) {
    __shared__ u32 s_go;
    KairosSlot* S = (KairosSlot*)P.slot_state;
    const bool leader = threadIdx.x == 0;
    const bool report = (P.flags & (KAIROS_FLAG_NOTIFY | KAIROS_FLAG_SILENT)) == KAIROS_FLAG_NOTIFY;
    const u32 b = P.first_block + blockIdx.x;
    if (leader) {
        bool go = P.gate_seq == 0u || *(volatile u32*)P.gate_word != P.gate_seq;
        if (P.flags & KAIROS_FLAG_STOP_WORD) {
            // Point 8: a raised stop word skips this CTA's block; the first launch to skip says so.
            const u64 w = *(volatile u64*)P.preempt_flag;
            if ((u32)w != 0u) {
                go = false;
                if ((u32)(w >> 32) == 0u) atomicCAS(&((KairosStopWord*)P.preempt_flag)->first_skipped, 0u, P.slot);
            }
        }
        s_go = go;
        if (go && blockIdx.x == 0 && report && (P.flags & KAIROS_FLAG_START_RECORD)) {
            kairos_emit(P, KAIROS_REC_PLACED, kairos_smid(), min(gridDim.x, 0x7ffu), 0, 1u);
        }
    }
    __syncthreads();
    const bool go = s_go != 0u;
    if (go && b < P.total_blocks) body(b);
    if (!report) return;
    __syncthreads();
    if (leader) {
        // This CTA's outputs are visible before it counts as done (to the host too, for outputs
        // in mapped host memory).
        if (P.flags & KAIROS_FLAG_FENCE_SYSTEM) __threadfence_system();
        else __threadfence();
        if (atomicInc(&S->light_out, gridDim.x - 1u) == gridDim.x - 1u) {
            // Stopped at the gate: the launch behind this one must stop too. Only the last CTA
            // out writes it, once every CTA of this launch has read the word.
            if (!go && P.gate_word != 0ull) {
                *(volatile u32*)P.gate_word = P.seq;
                __threadfence();
            }
            const u32 next_block = go ? P.total_blocks : P.first_block;
            kairos_emit(P, KAIROS_REC_DONE, kairos_smid(), 0, next_block, go ? 0u : 1u);
        }
    }
}

// Runs `body(logical_block)` under the protocol. Every thread of the CTA must call it, and
// `body` must be safe to call by all threads for one block (it may use __syncthreads).
template <typename Body>
__device__ __forceinline__ void kairos_run(const KairosProto& P, Body body) {
#ifdef KAIROS_PROTOCOL_OFF
    if (P.flags & KAIROS_FLAG_STOP_WORD) {
        // Point 8 in a plain grid (a kernel of a recorded run): a raised stop word skips the CTA.
        __shared__ u32 s_run;
        if (threadIdx.x == 0) {
            const u64 w = *(volatile u64*)P.preempt_flag;
            s_run = (u32)w == 0u;
            if (!s_run && (u32)(w >> 32) == 0u) atomicCAS(&((KairosStopWord*)P.preempt_flag)->first_skipped, 0u, P.slot);
        }
        __syncthreads();
        if (!s_run) return;
    }
    for (u32 b = P.first_block + blockIdx.x; b < P.total_blocks; b += gridDim.x) {
        body(b);
        __syncthreads();
    }
#else
    if (P.flags & KAIROS_FLAG_LIGHT) {
        kairos_run_light(P, body);
        return;
    }
    __shared__ u32 s_last;
    KairosSlot* S = (KairosSlot*)P.slot_state;
    const bool leader = threadIdx.x == 0;
    const u32 sm = kairos_smid();
    const bool in_mask = sm < KAIROS_SM_COUNT_MAX && ((P.sm_mask[sm >> 6] >> (sm & 63)) & 1ull);
    u32 ran = 0;
    if (in_mask) {  // uniform over the CTA: all its threads share the SM
        ran = kairos_take_loop(P, S, sm, body, true, (P.flags & KAIROS_FLAG_ONE_TAKE) != 0u);
        kairos_allow_dependents();
        if (leader) kairos_report_finished(P, S, sm, ran);
    } else {
        kairos_allow_dependents();
    }
    __syncthreads();
    const u32 left = P.total_blocks - P.first_block;
    if (leader) {
        // This CTA's outputs are visible before it counts as done (to the host too, for outputs
        // in mapped host memory). The count carries the blocks run, so the last CTA out knows
        // without another read whether the launch ran whole (the common case).
        if (P.flags & KAIROS_FLAG_FENCE_SYSTEM) __threadfence_system();
        else __threadfence();
        const u64 before = atomicAdd((unsigned long long*)&S->done, (1ull << 32) | (u64)ran);
        s_last = (u32)(before >> 32) != gridDim.x - 1u ? 0u : (u32)before + ran == left ? 2u : 1u;
    }
    __syncthreads();
    if (!s_last) return;
    if (s_last == 2u) {
        // Last CTA out of a launch that ran every block: no stop, no rescue, no gate to close.
        // The ring record is reserved beside the slot's reset; one fence orders both before the
        // record, so the host never reuses the slot before it is zero again.
        if (leader) {
            const bool notify = (P.flags & KAIROS_FLAG_NOTIFY) != 0u;
            KairosReservation r = {0ull, 0ull};
            if (notify) r = kairos_reserve_begin(P);
            // A run stops only with a word raised before this launch's first take, which then
            // takes no block: this is 0 here, read for the record all the same.
            const u32 skipped = (P.flags & KAIROS_FLAG_STOP_WORD)
                                    ? atomicExch(&((KairosStopWord*)P.preempt_flag)->first_skipped, 0u)
                                    : 0u;
            kairos_reset_slot(S);
            if (P.flags & KAIROS_FLAG_FENCE_SYSTEM) __threadfence_system();
            else __threadfence();
            if (notify) kairos_write_record(P, kairos_reserve_end(P, r), KAIROS_REC_DONE, sm, skipped, P.total_blocks, 0u);
        }
        return;
    }
    // The gate and the rescue below may read what the kernel before wrote.
    kairos_wait_prerequisite();
    __threadfence();
    // Last CTA out, blocks left: the launch was stopped or no CTA ran inside the mask.
    __shared__ u32 s_rescue;
    if (leader) {
        const u64 v = *(volatile u64*)&S->next;
        s_rescue = !(v & KAIROS_STOP_BIT) && (u32)v < left;
        if (s_rescue && kairos_gate_closed(P)) {
            // No CTA landed in the mask (none took a block): the gate stops the launch whole.
            kairos_stop_at_gate(S);
            s_rescue = 0;
        }
        if (s_rescue && kairos_flag_raised(P)) {
            kairos_stop(S);
            s_rescue = 0;
        }
        if (s_rescue) kairos_report_placed(P, S, sm);
    }
    __syncthreads();
    if (s_rescue) {
        const u32 rescued = kairos_take_loop(P, S, sm, body, false, false);
        if (leader) kairos_report_finished(P, S, sm, rescued);
    }
    if (leader) {
        if (P.flags & KAIROS_FLAG_FENCE_SYSTEM) __threadfence_system();
        else __threadfence();
        const u64 v = *(volatile u64*)&S->next;
        const u32 valid = (v & KAIROS_STOP_BIT) ? *(volatile u32*)&S->stop_at : (u32)v;
        const u32 next_block = P.first_block + (valid < left ? valid : left);
        // Point 8: where the run before this launch stopped (0: it ran whole), handed over once.
        const u32 skipped = (P.flags & KAIROS_FLAG_STOP_WORD)
                                ? atomicExch(&((KairosStopWord*)P.preempt_flag)->first_skipped, 0u)
                                : 0u;
        kairos_reset_slot(S);
        // Stopped early: close the gate of the launch behind this one on the stream.
        if (next_block < P.total_blocks && P.gate_word != 0ull) *(volatile u32*)P.gate_word = P.seq;
        __threadfence();
        kairos_emit(P, KAIROS_REC_DONE, sm, skipped, next_block, next_block < P.total_blocks ? 1u : 0u);
    }
#endif
}
