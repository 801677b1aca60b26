"""What the compiler's target asks of the CPU that runs the kernels (loader.load). A library built with
-march=TARGET may use any instruction set that target enables, anywhere in its code, not only in the
kernels' vector paths; on a CPU without one it stops at the first such instruction (SIGILL). So:

- ``compiler_target`` asks the compiler what -march=TARGET means to it: its predefined macros, which
  carry its version (``__VERSION__``) and every instruction set the target turns on (``__AVX512F__``);
  they are part of the cached library's name, so a build is reused only by the same compiler for the same
  resolved target (``native`` resolves per CPU);
- ``missing_flags`` holds those instruction sets against this CPU's /proc/cpuinfo flags: a target named
  in ``AIAYN_KERNELS_MARCH`` that this CPU cannot run (x86-64-v4 on a CPU without AVX-512, an environment
  shared by the nodes of a mixed cluster) is not built, and PyTorch's operations run.
"""
from __future__ import annotations

import os
import re
import subprocess

# x86 compiler macros and /proc/cpuinfo's names for the instruction sets they stand for (Linux's
# arch/x86/include/asm/cpufeatures.h); what x86-64-v2, -v3 and -v4 enable, and the extensions of
# the named CPUs after them (VNNI, bfloat16, float16, AMX)
X86_FLAGS = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm", "__MOVBE__": "movbe",
    "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd", "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16", "__AVXVNNI__": "avx_vnni",
    "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8",
}
_DEFINED = re.compile(r"^#define (__\w+__) ", re.MULTILINE)


def compiler_target(cc: str, march: str) -> str:
    """The compiler ``cc``'s predefined macros under -march=``march``: its version and the instruction sets
    the target enables; "" where it cannot say (a target it does not know: the build then reports it or,
    for ``native``, falls back to the portable loops)."""
    cmd = [*cc.split(), f"-march={march}", "-dM", "-E", "-x", "c", os.devnull]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def missing_flags(target: str, flags: frozenset[str]) -> list[str]:
    """The CPU flags (/proc/cpuinfo's names) of the instruction sets ``target`` (``compiler_target``'s
    macros) enables that ``flags`` lacks; none where the flags are unknown (not x86, or unreadable)."""
    if not flags:
        return []
    return sorted({X86_FLAGS[m] for m in _DEFINED.findall(target) if m in X86_FLAGS} - flags)
