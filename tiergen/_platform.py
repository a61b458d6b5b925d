"""Process-wide settings that must be in place before torch runs its first kernel.

Some virtual machines advertise Intel AMX in /proc/cpuinfo but hide the CPUID leaves that
describe the tiles; oneDNN then takes its AMX path on the first bfloat16 matmul and the
process dies with SIGILL. Capping oneDNN at AVX512_CORE_BF16 on CPUs that advertise AMX
avoids that. A user who knows their AMX works sets ONEDNN_MAX_CPU_ISA themselves (e.g. to
"ALL"), and tiergen leaves it alone.
"""

import os


def _cpu_advertises_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


if "ONEDNN_MAX_CPU_ISA" not in os.environ and _cpu_advertises_amx():
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
