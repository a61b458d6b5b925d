import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A test that fails while its parallel ranks run must not fail the tests after it."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Builds of the kernels for other instruction sets than -march=native picks here, each run
# where the CPU can execute it, so that no instruction set's code goes untested by the machine
# that happens to run the suite: (flags, the CPU flags the build needs, what tg_int8_isa says).
ISA_BUILDS = {
    "avx2": (["-march=haswell"], {"avx2", "fma", "f16c"}, 1),  # an AMD EPYC before Zen 4
    "avx-vnni": (["-march=haswell", "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}, 2),
    "avx512": (["-march=skylake-avx512"],  # AVX-512 without VNNI
               {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}, 1),
    "avx512-vnni": (["-march=icelake-server"], {"avx512_vnni", "avx512vl"}, 2),
    "portable": (["-march=x86-64"], set(), 0),  # no AVX2: the plain C loops
}


@pytest.fixture(scope="session", params=sorted(ISA_BUILDS))
def isa_library(request):
    """The kernels built for one instruction set (cached as the native build is); a test puts
    it in place with ``monkeypatch.setattr(kernels, "_lib", isa_library)``."""
    import ctypes
    import platform

    from tiergen import kernels
    from tiergen._platform import cpu_flags

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction-set builds")
    march, needs, level = ISA_BUILDS[request.param]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {request.param} build ({' '.join(sorted(needs))})")
    flags = [f for f in kernels.FLAGS if not f.startswith(("-march", "-mcpu"))] + march
    path = kernels.build_path(flags, f"isa-{request.param}")
    if not path.exists():
        kernels._compile(path, flags)
    lib = kernels.bind(ctypes.CDLL(str(path)))
    assert lib.tg_int8_isa() == level
    return lib


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny_models case's checkpoint directory by name, each built once per module."""
    from tiny_models import build

    made = {}

    def get(case):
        if case not in made:
            made[case] = tmp_path_factory.mktemp(case)
            build(case, made[case])
        return made[case]
    return get
