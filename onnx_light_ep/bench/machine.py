"""Machine metadata and process-memory probes for the benchmark (Linux; degrades elsewhere).

``machine_info()`` returns a JSON-able dict: CPU model, cores, caches (lscpu
and sysfs), memory, flags of interest, onnxruntime / numpy / onnx_light_ep
versions, the native library path, the attention ISA in use
(``_core.isa()``), the machine kind (``machine_kind``: vendor, microarchitecture
and vector ISA, the key of BENCHMARKS.md's per-machine blocks), the source
revision (``source_revision``), the measured one-core multiply-add peak per ISA
level (``_core.fma_peak``, GFMA/s) and, optionally, the measured single- and
two-thread streaming read bandwidth of ``_core.stream_read`` over a 512 MiB buffer.
"""

from __future__ import annotations

import concurrent.futures
import os
import platform
import re
import subprocess
import sys
import time
from typing import Dict, Optional

import numpy as np

from .. import _core

_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile",
                      "amx_bf16", "f16c", "fma")


def _lscpu() -> Dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in out.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip()] = v.strip()
    return fields


def _sysfs_cache_bytes(level: int) -> Optional[int]:
    """Size of the data/unified cache of ``level`` seen by cpu0 (one instance), in bytes."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(base)):
            d = os.path.join(base, idx)
            with open(os.path.join(d, "level")) as f:
                if int(f.read()) != level:
                    continue
            with open(os.path.join(d, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(d, "size")) as f:
                m = re.match(r"(\d+)([KMG]?)", f.read().strip())
            if m:
                return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    except OSError:
        return None
    return None


def _mem_total_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_bandwidth_gb_per_s(threads: int = 1, nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Best of ``repeats`` timed ``_core.stream_read`` passes over a fresh buffer (GB/s, 1e9)."""
    buf = np.ones(nbytes, dtype=np.uint8)
    parts = np.array_split(buf, threads)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(_core.stream_read, parts))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


# AMD families 0x17-0x1a and Intel family 6 server models -> microarchitecture (lscpu's
# "CPU family" and "Model"; a hypervisor may hide the model name but passes these on).
# Family 0x17 spans three: models below 0x30 are Zen 1 (EPYC 7001 "Naples" is model 1) but
# 0x08 and 0x18, Zen+; from 0x30 on, Zen 2 (EPYC 7002 "Rome" is model 0x31). Zen 1 and Zen+
# execute 256-bit AVX2 as two 128-bit halves: half the FMA throughput of Zen 2 and later.
_AMD_FAMILIES = {26: "Zen 5"}
_INTEL_MODELS = {85: "Skylake-SP/Cascade Lake", 106: "Ice Lake-SP", 143: "Sapphire Rapids",
                 207: "Emerald Rapids", 173: "Granite Rapids"}


def _amd_family23(model: int) -> str:
    """AMD family 0x17's microarchitecture from its model number (see above)."""
    if model >= 0x30:
        return "Zen 2"
    return "Zen+" if model in (0x08, 0x18) else "Zen 1"


def machine_kind(ls: Optional[Dict[str, str]] = None, flags: Optional[set] = None) -> str:
    """Vendor, microarchitecture and widest vector ISA, e.g. ``AMD Zen 4 AVX-512``.

    ``ls``: lscpu fields (default: this machine's); ``flags``: its CPU flags (default: lscpu's).
    AMD family 25 is Zen 3 without AVX-512 and Zen 4 with it; family 23 is Zen 1, Zen+ or Zen 2
    by model number (``_amd_family23``); an Intel model not in the table is
    named by its family and model numbers (``Intel Xeon (family 6 model 167) AVX-512``).
    """
    ls = _lscpu() if ls is None else ls
    flags = set(ls.get("Flags", "").split()) if flags is None else set(flags)
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
    vendor, name = ls.get("Vendor ID", ""), ls.get("Model name", "") or platform.processor()
    try:
        family, model = int(ls.get("CPU family", "")), int(ls.get("Model", ""))
    except ValueError:
        family = model = None
    if vendor == "AuthenticAMD":
        if family == 25:
            arch = "Zen 4" if "avx512f" in flags else "Zen 3"
        elif family == 23 and model is not None:
            arch = _amd_family23(model)
        else:
            arch = _AMD_FAMILIES.get(family)
        return f"AMD {arch or f'(family {family} model {model})'} {isa}"
    if vendor == "GenuineIntel":
        arch = _INTEL_MODELS.get(model) if family == 6 else None
        short = "Xeon" if "Xeon" in name else "Core" if "Core" in name else "CPU"
        return f"Intel {arch or f'{short} (family {family} model {model})'} {isa}"
    return f"{name or platform.machine()} {isa}".strip()


#: The commit an installed package was built from, written by the CMake build (CMakeLists.txt):
#: one line, empty when the build's source was not a git checkout.
RECORDED_REVISION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "source_revision.txt")


def recorded_revision(path: str = RECORDED_REVISION) -> Optional[str]:
    """The revision the build recorded in ``path``, or None (no file, or an empty one)."""
    try:
        with open(path, encoding="utf-8") as f:
            rev = f.read().strip()
    except OSError:
        return None
    return rev or None


def checkout_revision() -> Optional[str]:
    """``git rev-parse --short=12 HEAD`` (``-dirty`` with uncommitted changes to tracked files
    other than Markdown, which a ``--benchmarks-md`` run itself rewrites) when this package is
    imported from a git checkout of this project, else None."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if (top.returncode == 0 and os.path.samefile(top.stdout.strip(), root)
                and os.path.isfile(os.path.join(root, "pyproject.toml"))):
            rev = git("rev-parse", "--short=12", "HEAD").stdout.strip()
            if rev:
                dirty = git("diff", "--quiet", "HEAD", "--", ".", ":(exclude)*.md").returncode == 1
                return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def source_revision() -> str:
    """The source this package was built from: ``$OLEP_SOURCE_REVISION`` if set, else the
    checkout's commit when the package is imported from a git checkout (``checkout_revision``),
    else the commit its build recorded (``recorded_revision``, the same form, taken at build
    time), else ``onnx_light_ep <version>`` (an installed package built from an sdist)."""
    from .. import __version__

    if os.environ.get("OLEP_SOURCE_REVISION"):
        return os.environ["OLEP_SOURCE_REVISION"]
    return checkout_revision() or recorded_revision() or f"onnx_light_ep {__version__}"


#: ``_core.fma_peak`` level of the fp32 FMAs each attention ISA level runs (scalar: none).
FP32_PEAK_LEVEL = {"avx2": "fp32_avx2", "avx512": "fp32_avx512", "avx512_bf16": "fp32_avx512"}


def fma_peaks(ms: float = 50.0, trials: int = 5) -> Dict[str, Optional[float]]:
    """{level: one-core GFMA/s, None where the CPU lacks it} for every ``_core.fma_peak`` level
    (about ``levels x trials x ms`` of CPU time)."""
    return {lv["name"]: (round(g, 1) if (g := _core.fma_peak(lv["name"], ms, trials)) else None)
            for lv in _core.fma_peak_levels()}


def machine_info(measure_bandwidth: bool = True, fma_ms: float = 50.0, fma_trials: int = 5) -> Dict:
    """JSON-able description of this machine and software stack.

    ``measure_bandwidth``: time ``stream_read`` at 1 and 2 threads (a few seconds);
    ``fma_ms``/``fma_trials``: the FMA-peak measurement (``fma_peaks``; 0 ms: not measured).
    """
    import onnxruntime as ort

    from .. import __version__, get_library_path

    ls = _lscpu()
    flags = set(ls.get("Flags", "").split())
    info = {
        "cpu_model": ls.get("Model name", platform.processor()),
        "num_cpus": os.cpu_count(),
        "cores_per_socket": ls.get("Core(s) per socket"),
        "threads_per_core": ls.get("Thread(s) per core"),
        "sockets": ls.get("Socket(s)"),
        "hypervisor": ls.get("Hypervisor vendor"),
        "lscpu_caches": {k: ls[k] for k in ("L1d cache", "L2 cache", "L3 cache") if k in ls},
        "l2_bytes_per_instance": _sysfs_cache_bytes(2),
        "llc_bytes": _sysfs_cache_bytes(3) or _sysfs_cache_bytes(2),
        "mem_total_bytes": _mem_total_bytes(),
        "cpu_flags": sorted(f for f in _FLAGS_OF_INTEREST if f in flags),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "onnxruntime": ort.__version__,
        "onnx_light_ep": __version__,
        "library_path": get_library_path(),
        "isa": _core.isa(),
        "detected_isa": _core.detected_isa(),
        "machine_kind": machine_kind(ls, flags),
        "source_revision": source_revision(),
    }
    if fma_ms:
        info["fma_peak_gfma_per_s"] = fma_peaks(fma_ms, fma_trials)
    if measure_bandwidth:
        info["stream_read_gb_per_s"] = {str(t): round(read_bandwidth_gb_per_s(t), 2) for t in (1, 2)}
    return info


def read_status_kib(key: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``); 0 if unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``/proc/self/clear_refs`` "5"); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
