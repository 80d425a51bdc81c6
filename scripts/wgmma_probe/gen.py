"""Writes wgmma_probe.cu from wgmma_probe.cu.in: the inline-assembly wrappers of wgmma.mma_async
m64nNk16 (f16 inputs, f32 accumulators) for N = 64, 128, 256, whose operand lists are too long to
write by hand. Usage: python3 gen.py OUT.cu"""
import os
import sys


def wgmma_wrapper(n):
    regs = n // 2
    lst = ",".join("%%%d" % i for i in range(regs))
    outs = ", ".join('"+f"(d[%d])' % i for i in range(regs))
    return f'''
__device__ __forceinline__ void wgmma_n{n}(float* d, unsigned long long da, unsigned long long db) {{
    asm volatile("{{\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{lst}}}, %{regs}, %{regs + 1}, 1, 1, 1, 0, 0;\\n"
        "}}\\n" : {outs} : "l"(da), "l"(db));
}}
'''


here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, "wgmma_probe.cu.in")).read()
src = src.replace("//WGMMA_FUNCS", "".join(wgmma_wrapper(n) for n in (64, 128, 256)))
open(sys.argv[1], "w").write(src)
