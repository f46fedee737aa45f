"""Hardware profiles: capacities, bandwidths and rates of the levels a cost is read against.

A profile stores what vendors publish per SM and per clock; device-wide rates are derived
(``SMs x per-clock x clock``), so the numbers the paper quotes come out rather than being
typed in: H100 SXM FP16 dense = 132 x 4096 x 1.83 GHz = 989.4 TFLOP/s.

Sources (cited per field below):

[DS-H100]  NVIDIA H100 Tensor Core GPU datasheet,
           https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
           (H100 SXM: 80 GB HBM3, 3.35 TB/s; FP16/BF16 tensor 1,979 TFLOP/s *with sparsity*,
           FP8 3,958 with sparsity, TF32 989 with sparsity, FP32 67, FP64 34 TFLOP/s).
[WP-H100]  NVIDIA H100 Tensor Core GPU Architecture whitepaper (GTC22),
           https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper
           (132 SMs on SXM5, 50 MB L2, 256 KB register file and up to 228 KB shared memory
           per SM; dense tensor FLOP/clk/SM; peak rates at the 1.83 GHz boost clock for tensor
           math, 1.98 GHz for FP32/FP64/FP16 CUDA-core math).
[DS-H200]  NVIDIA H200 Tensor Core GPU product page / datasheet,
           https://www.nvidia.com/en-us/data-center/h200/ (141 GB HBM3e, 4.8 TB/s; same GH100
           compute as H100 SXM).
[DS-A100]  NVIDIA A100 Tensor Core GPU datasheet,
           https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
           (A100 80GB SXM: 2,039 GB/s HBM2e; FP16/BF16 tensor 312 TFLOP/s dense, TF32 156,
           FP32 19.5, FP64 9.7, INT8 624 TOPS).
[WP-A100]  NVIDIA A100 Tensor Core GPU Architecture whitepaper,
           https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf
           (108 SMs, 1.41 GHz boost, 40 MB L2, L2 read bandwidth 5120 B/clk, 164 KB shared
           memory per SM, 256 KB registers per SM).
[CUDA-PG]  CUDA C++ Programming Guide, "Compute Capabilities" (technical specifications and
           arithmetic-instruction throughput tables),
           https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#compute-capabilities
           (48 KB static shared memory per block; opt-in maximum 227 KB per block on 9.0 and
           163 KB on 8.0; 228 KB / 164 KB per SM; 64K 32-bit registers per SM and per block;
           64 resident warps and 32 resident blocks per SM; 1024 threads per block; 1 KB of
           shared memory reserved per block; warp size 32; compute capability 9.0 for H100 /
           H200, 8.0 for A100; 32 banks x 4 bytes of shared memory per clock; special
           function unit: 16 results per clock per SM for exp2/log2/rsqrt/rcp/sin/cos).
[NAPKIN]   FlashAttention on a Napkin (Abbott & Zardini, arXiv 2412.03317) App. B.1 / section
           5.7 as transcribed in ../shared/NAPKIN.md: H100 tensor clock 1.83 GHz, SFU 16/clk/SM,
           the "SMEM" level (L2 -> SMEM) at 6.0e12 FP16 values/s = 12 TB/s.
[NVL]      NVIDIA H100 / H200 datasheets (as DS-H100, DS-H200): "NVLink: 900GB/s" per GPU, the
           sum of both directions over its 18 fourth-generation links, so 450 GB/s each way.
[ASSUMED]  Not a vendor figure: the link latency (a few microseconds, the order of an NCCL
           point-to-point message on one NVLink host); ``kernels/bench_multi_gpu.py`` measures it.
[LUO24]    Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture",
           arXiv 2402.13499: distributed shared memory (cluster) throughput measured on H800
           (an H100 SM): cluster of 2 -> 3.27 TB/s, of 4 -> 2.65 TB/s, GMEM <-> SMEM 2.04 TB/s.

>>> from napkin_cat.core.hardware import H100, H200
>>> round(H100.tensor_rate("f16") / 1e12, 1)
989.4
>>> H100.capacity("SMEM"), H100.smem_per_block_static
(232448, 49152)
>>> H200.bandwidth("HBM") / H100.bandwidth("HBM") > 1.4
True
>>> H200.bandwidth("NVLink") / 1e9, H200.link_latency   # one way, per GPU
(450.0, 5e-06)
>>> H100.compute_capability, H100.max_threads_per_sm, H100.registers_per_block // 4
((9, 0), 2048, 65536)

The launch limits the lowering sizes kernels against (``napkin_cat.lowering.devices``'s
``H100_DEFAULTS``) are derived from these profiles, so each number is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from .diagram import DType
from .errors import CostError

KB = 1024
MB = 1024 * KB
GB = 1024 * MB


FP32_ENGINES = {"fma": None, "3xtf32": ("tf32", 3)}
"""The engines an fp32 contraction can run on (``lower(..., fp32=...)``), each with the tensor
dtype and the products per product it takes on tensor cores (None: CUDA-core FMAs)."""


class FrozenDict(dict):
    """A dict that refuses changes: the mappings frozen results hand out print as dicts."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("read-only mapping")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse


def _ro(d: dict) -> Mapping:
    return FrozenDict(d)


@dataclass(frozen=True)
class Hardware:
    """One GPU.  Per-SM, per-clock figures are the data; device rates are derived."""

    name: str
    sms: int
    clock_hz: float                 # CUDA-core / SFU clock
    tensor_clock_hz: float          # clock the dense tensor-core rates are quoted at
    hbm_bytes: int
    hbm_bandwidth: float            # bytes/s
    l2_bytes: int
    l2_bandwidth: float | None      # bytes/s, L2 -> SM (None where not published)
    smem_per_sm: int                # bytes
    smem_per_block_static: int      # bytes without opt-in
    smem_per_block_optin: int       # bytes with cudaFuncAttributeMaxDynamicSharedMemorySize
    smem_bytes_per_clk_per_sm: int  # 32 banks x 4 bytes
    registers_per_sm: int           # bytes (64K x 32-bit)
    max_warps_per_sm: int
    tensor_per_clk: Mapping[str, int]   # dense FLOP/clk/SM by dtype name
    vector_per_clk: Mapping[str, int]   # CUDA-core FLOP/clk/SM by dtype name (an add or a mul = 1)
    sfu_per_clk: int                    # special-function results/clk/SM
    compute_capability: tuple[int, int]
    warp_size: int                      # threads
    max_threads_per_block: int
    max_blocks_per_sm: int              # resident blocks
    reserved_smem_per_block: int        # bytes of shared memory the system keeps per block
    registers_per_block: int            # bytes (64K x 32-bit)
    cluster_bandwidth: Mapping[int, float] = field(default_factory=lambda: _ro({}))  # N -> bytes/s
    link_bandwidth: float | None = None   # bytes/s one way from one GPU to a peer (None: no link modelled)
    link_latency: float | None = None     # seconds per message over the link
    sources: tuple[str, ...] = ()

    # ---- the fp32 engine
    def fp32_on(self, engine: str) -> "Hardware":
        """This GPU with its fp32 contractions priced on ``engine``, one of :data:`FP32_ENGINES`
        (``lower(..., fp32=engine)``): ``"fma"``, CUDA-core FMAs, is this profile itself;
        ``"3xtf32"`` multiplies on the tensor cores by three tf32 products a product
        (``big big + big small + small big``), a third of the dense tf32 rate.

        >>> round(H100.fp32_on("3xtf32").tensor_rate("f32") / 1e12, 1), round(H100.tensor_rate("f32") / 1e12, 1)
        (164.9, 66.9)
        """
        if engine not in FP32_ENGINES:
            raise CostError(f"{self.name}: the fp32 engine must be one of {tuple(FP32_ENGINES)}, got {engine!r}")
        rule = FP32_ENGINES[engine]
        if rule is None:
            return self
        dtype, products = rule
        if dtype not in self.tensor_per_clk:
            raise CostError(f"{self.name}: fp32 by {engine} needs {dtype} tensor cores, which this profile lacks")
        per_clk = dict(self.tensor_per_clk, f32=self.tensor_per_clk[dtype] / products)
        return replace(self, name=f"{self.name}, fp32 by {engine}", tensor_per_clk=_ro(per_clk))

    # ---- rates (per second, whole device)
    def tensor_rate(self, dtype: DType | str) -> float:
        """Dense tensor-core FLOP/s for ``dtype``; dtypes without tensor cores run at the
        CUDA-core rate (an f32 contraction is FP32 SIMT work: TF32 is another precision)."""
        name = _name(dtype)
        if name in self.tensor_per_clk:
            return self.sms * self.tensor_per_clk[name] * self.tensor_clock_hz
        return self.vector_rate(name)

    def vector_rate(self, dtype: DType | str) -> float:
        """CUDA-core FLOP/s for elementwise work in ``dtype`` (fp8 math runs as f16)."""
        name = _name(dtype)
        name = {"fp8_e4m3": "f16", "fp8_e5m2": "f16", "i8": "f32"}.get(name, name)
        if name not in self.vector_per_clk:
            raise CostError(f"{self.name}: no CUDA-core rate for dtype {name}; "
                            f"known: {sorted(self.vector_per_clk)}")
        return self.sms * self.vector_per_clk[name] * self.clock_hz

    @property
    def max_threads_per_sm(self) -> int:
        """Resident threads per SM: resident warps times the warp size."""
        return self.max_warps_per_sm * self.warp_size

    @property
    def sfu_rate(self) -> float:
        return self.sms * self.sfu_per_clk * self.clock_hz

    def rate(self, unit: str, dtype: DType | str) -> float:
        if unit == "tensor":
            return self.tensor_rate(dtype)
        if unit == "fma":
            return self.vector_rate(dtype)
        if unit == "exp":
            return self.sfu_rate
        raise CostError(f"unknown compute unit {unit!r}; units are tensor, fma, exp")

    # ---- levels
    def capacity(self, level: str) -> int:
        """Bytes one group may hold at ``level``: SMEM is the per-block opt-in maximum."""
        caps = {"HBM": self.hbm_bytes, "L2": self.l2_bytes, "SMEM": self.smem_per_block_optin,
                "cluster": self.smem_per_block_optin, "registers": self.registers_per_sm}
        if level not in caps:
            raise CostError(f"{self.name} has no capacity for level {level!r}; levels: {sorted(caps)}")
        return caps[level]

    def bandwidth(self, level: str) -> float | None:
        """Bytes/s out of ``level`` into the level below (None where not modelled)."""
        bws = {"HBM": self.hbm_bandwidth, "L2": self.l2_bandwidth,
               "SMEM": self.sms * self.smem_bytes_per_clk_per_sm * self.clock_hz,
               "NVLink": self.link_bandwidth}
        return bws.get(level)

    def into(self, level: str, parent: str) -> float | None:
        """Bytes/s into ``level`` from ``parent`` (the parent's outgoing bandwidth)."""
        return self.bandwidth(parent)


def _name(dtype) -> str:
    return dtype.name if isinstance(dtype, DType) else str(dtype)


_SOURCES_H100 = ("DS-H100", "WP-H100", "CUDA-PG", "NAPKIN", "LUO24")

H100_SXM5 = Hardware(
    name="H100 SXM5 80GB",
    sms=132,                                   # WP-H100
    clock_hz=1.98e9,                           # WP-H100: FP32 67 TFLOP/s = 132 x 256 x 1.98 GHz
    tensor_clock_hz=1.83e9,                    # WP-H100 / NAPKIN: 989.4 = 132 x 4096 x 1.83 GHz
    hbm_bytes=80 * GB,                         # DS-H100
    hbm_bandwidth=3.35e12,                     # DS-H100
    l2_bytes=50 * MB,                          # WP-H100
    l2_bandwidth=12.0e12,                      # NAPKIN: 6.0e12 FP16 values/s (not published by NVIDIA)
    smem_per_sm=228 * KB,                      # CUDA-PG cc 9.0
    smem_per_block_static=48 * KB,             # CUDA-PG
    smem_per_block_optin=227 * KB,             # CUDA-PG cc 9.0
    smem_bytes_per_clk_per_sm=128,             # CUDA-PG: 32 banks x 4 B
    registers_per_sm=256 * KB,                 # WP-H100 / CUDA-PG: 64K x 32-bit
    max_warps_per_sm=64,                       # CUDA-PG
    tensor_per_clk=_ro({"f16": 4096, "bf16": 4096, "fp8_e4m3": 8192, "fp8_e5m2": 8192,
                        "i8": 8192, "tf32": 2048, "f64": 128}),   # WP-H100 dense, per SM per clock
    vector_per_clk=_ro({"f32": 256, "f16": 512, "bf16": 512, "f64": 128}),  # WP-H100 / CUDA-PG
    sfu_per_clk=16,                            # CUDA-PG
    compute_capability=(9, 0),                 # CUDA-PG
    warp_size=32,                              # CUDA-PG
    max_threads_per_block=1024,                # CUDA-PG
    max_blocks_per_sm=32,                      # CUDA-PG cc 9.0
    reserved_smem_per_block=1 * KB,            # CUDA-PG cc 9.0
    registers_per_block=256 * KB,              # CUDA-PG: 64K x 32-bit
    cluster_bandwidth=_ro({1: 2.04e12, 2: 3.27e12, 4: 2.65e12}),   # LUO24 (measured, H800)
    link_bandwidth=450e9,                      # NVL: 900 GB/s both ways -> 450 GB/s one way
    link_latency=5e-6,                         # ASSUMED
    sources=_SOURCES_H100 + ("NVL", "ASSUMED"),
)
H100 = H100_SXM5

H200 = Hardware(
    name="H200 SXM 141GB",
    sms=132, clock_hz=1.98e9, tensor_clock_hz=1.83e9,           # DS-H200: GH100 as H100 SXM
    hbm_bytes=141 * 10**9,                                      # DS-H200
    hbm_bandwidth=4.8e12,                                       # DS-H200
    l2_bytes=50 * MB, l2_bandwidth=12.0e12,
    smem_per_sm=228 * KB, smem_per_block_static=48 * KB, smem_per_block_optin=227 * KB,
    smem_bytes_per_clk_per_sm=128, registers_per_sm=256 * KB, max_warps_per_sm=64,
    tensor_per_clk=H100_SXM5.tensor_per_clk, vector_per_clk=H100_SXM5.vector_per_clk,
    sfu_per_clk=16, compute_capability=(9, 0), warp_size=32, max_threads_per_block=1024,
    max_blocks_per_sm=32, reserved_smem_per_block=1 * KB, registers_per_block=256 * KB,
    cluster_bandwidth=H100_SXM5.cluster_bandwidth,
    link_bandwidth=450e9, link_latency=5e-6,                    # NVL (NVLink 4, as H100), ASSUMED
    sources=("DS-H200", "WP-H100", "CUDA-PG", "NAPKIN", "LUO24", "NVL", "ASSUMED"),
)

A100_SXM4 = Hardware(
    name="A100 SXM4 80GB",
    sms=108,                                   # WP-A100
    clock_hz=1.41e9, tensor_clock_hz=1.41e9,   # WP-A100: 312 = 108 x 2048 x 1.41 GHz
    hbm_bytes=80 * GB,                         # DS-A100
    hbm_bandwidth=2.039e12,                    # DS-A100 (80GB SXM)
    l2_bytes=40 * MB,                          # WP-A100
    l2_bandwidth=5120 * 1.41e9,                # WP-A100: 5120 B/clk L2 read bandwidth
    smem_per_sm=164 * KB,                      # CUDA-PG cc 8.0
    smem_per_block_static=48 * KB,             # CUDA-PG
    smem_per_block_optin=163 * KB,             # CUDA-PG cc 8.0
    smem_bytes_per_clk_per_sm=128,
    registers_per_sm=256 * KB,
    max_warps_per_sm=64,
    tensor_per_clk=_ro({"f16": 2048, "bf16": 2048, "i8": 4096, "tf32": 1024, "f64": 128}),  # DS/WP-A100
    vector_per_clk=_ro({"f32": 128, "f16": 512, "bf16": 512, "f64": 64}),                    # DS/WP-A100
    sfu_per_clk=16,
    compute_capability=(8, 0),                 # CUDA-PG
    warp_size=32,
    max_threads_per_block=1024,
    max_blocks_per_sm=32,                      # CUDA-PG cc 8.0
    reserved_smem_per_block=1 * KB,            # CUDA-PG cc 8.0
    registers_per_block=256 * KB,
    sources=("DS-A100", "WP-A100", "CUDA-PG"),
)

PROFILES = {"A100_SXM4": A100_SXM4, "H100": H100, "H100_SXM5": H100_SXM5, "H200": H200}
