"""What this CPU's instructions let oneDNN use: the CPU's flags (/proc/cpuinfo) held against
``ONEDNN_MAX_CPU_ISA``, the variable that caps oneDNN's instruction set (a CPU held to AVX2, say).
``onednn_uses`` answers for any set of flags; int8 decoding asks it about VNNI
(``aiayn.decode.int8.onednn_vnni``), training's precision about bf16
(``aiayn.train.runtime.cpu_supports_bf16``)."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Mapping

# ONEDNN_MAX_CPU_ISA values under which oneDNN uses each CPU flag's instructions (its ISAs are partially
# ordered: AVX2 < AVX2_VNNI < AVX2_VNNI_2; AVX2 < AVX512_CORE < AVX512_CORE_VNNI < AVX512_CORE_BF16
# < AVX10_1_512 < AVX10_1_512_AMX < AVX10_1_512_AMX_FP16; AVX2_VNNI < AVX10_1_512). Unset, DEFAULT or a
# value not listed in ``ISA_LIMITS``: no limit.
AMX_ISAS = frozenset({"AVX10_1_512_AMX", "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16"})
AVX10_ISAS = AMX_ISAS | {"AVX10_1_512", "AVX512_CORE_FP16"}
# the int8 dot products (VNNI) and the bf16 products; AVX2_VNNI_2 converts to and from bf16 but has no
# bf16 products, so below AVX512_CORE_BF16 oneDNN emulates bf16
VNNI_ISAS = {"amx_int8": AMX_ISAS,
             "avx512_vnni": AVX10_ISAS | {"AVX512_CORE_VNNI", "AVX512_CORE_BF16"},
             "avx_vnni": AVX10_ISAS | {"AVX2_VNNI", "AVX2_VNNI_2"}}
BF16_ISAS = {"amx_bf16": AMX_ISAS, "avx512_bf16": AVX10_ISAS | {"AVX512_CORE_BF16"}}
ISA_LIMITS = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"}).union(*VNNI_ISAS.values(), *BF16_ISAS.values())


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def onednn_uses(allowed: Mapping[str, frozenset[str]], flags: frozenset[str] | None = None,
                env: Mapping[str, str] | None = None) -> bool:
    """Whether oneDNN runs on the instructions of one of ``allowed``'s flags: the CPU has it (``flags``,
    else /proc/cpuinfo's) and ``ONEDNN_MAX_CPU_ISA`` (or its older name ``DNNL_MAX_CPU_ISA``; ``env``,
    else the environment) is unset or one of the limits that flag's instructions pass."""
    flags = cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    limit = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return any(flag in flags and (limit not in ISA_LIMITS or limit in isas) for flag, isas in allowed.items())
