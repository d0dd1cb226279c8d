"""How much arithmetic a training step does, and how much of the hardware's peak that is (MFU).

Every step reports it through metrics.py: FLOP/s per rank in each epoch's line, and
`flops_per_sample`, `flops_per_sec_per_rank`, `peak_flops_per_rank` and `mfu` in summary.json.

- The FLOPs are counted, not estimated: FlopCounterMode runs one forward and backward on the
  meta device (shapes only) and adds up what each convolution and matmul costs. For this CNN that is about 72 MFLOP per
  training sample, 10 times the "6 x parameters" rule of thumb for transformers (1.2 M
  parameters x 6 = 7.2 MFLOP): that rule counts each weight once per sample, and a convolution
  applies each of its weights at every position of the image (conv2: 576 positions).
- The peak is a GPU's datasheet number for dense math in the precision the step computes in
  (bf16 with --amp, else TF32, which choose_device turns on), or on a CPU a float32 matmul
  measured here on one thread at the end of the run, times the rank's threads. MFU = achieved /
  peak. A small CNN fed from a DataLoader is far from its peak (nanoGPT's train.py prints MFU
  against an A100's 312 TFLOP/s bf16; the PaLM paper, which named it, reports 46 %).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from .model import build_model

# Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, FLOP/s: (bf16, tf32) by
# (model, variant) as torch.cuda.get_device_name() spells them, e.g. "NVIDIA H100 80GB HBM3",
# "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "Tesla V100-PCIE-16GB". The model must match
# exactly: as substrings, "L4" would match an L40, "A10" an A10G (AWS's variant, whose peak NVIDIA
# does not publish: it is left unknown rather than guessed) and "H100" an H100 NVL. A variant
# listed here (PCIe, NVL) must be one of the name's words; otherwise the model's main form (None:
# SXM for H100/H200) applies. V100 and T4 have neither bf16 nor TF32: their fp32 peak stands in
# both columns (--amp trains them in fp32).
GPU_PEAKS = {
    ("H200", None): (989e12, 494e12),
    ("H200", "NVL"): (835e12, 418e12),
    ("H100", None): (989e12, 494e12),  # SXM
    ("H100", "PCIE"): (756e12, 378e12),
    ("H100", "NVL"): (835e12, 418e12),
    ("A100", None): (312e12, 156e12),  # SXM and PCIe alike
    ("L40S", None): (362e12, 183e12),
    ("L40", None): (181e12, 90.5e12),
    ("A10", None): (125e12, 62.5e12),
    ("L4", None): (121e12, 60e12),
    ("V100", None): (15.7e12, 15.7e12),  # SXM2
    ("V100", "PCIE"): (14e12, 14e12),
    ("T4", None): (8.1e12, 8.1e12),
}


def gpu_peaks(name: str) -> tuple[float, float] | None:
    """(bf16, tf32) peak FLOP/s of the GPU torch names `name`, or None for one not listed.

    The name's words (split at spaces and dashes) after the vendor: the first is the model, and
    the most specific listed variant among the others wins."""
    words = name.upper().replace("-", " ").split()
    if words and words[0] in ("NVIDIA", "TESLA"):
        words = words[1:]
    if not words:
        return None
    model, others = words[0], set(words[1:])
    for (listed_model, variant), peaks in GPU_PEAKS.items():
        if listed_model == model and variant in others:
            return peaks
    return GPU_PEAKS.get((model, None))


def training_flops_per_sample(args) -> int:
    """FLOPs of one forward and backward of the model the steps train, per sample."""
    shape = SimpleNamespace(dropout=False, width=getattr(args, "width", 1))
    with torch.device("meta"):
        model = build_model(shape, seed=0)
        images = torch.empty(8, 1, 28, 28)
    counter = FlopCounterMode(display=False)
    with counter:
        model(images).sum().backward()
    return counter.get_total_flops() // len(images)


def peak_flops(device: torch.device, bf16: bool) -> tuple[float | None, str]:
    """This rank's peak FLOP/s and where the number comes from (None where unknown)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peaks = gpu_peaks(name)
        if peaks is None:
            return None, f"{name}: peak unknown (add it to harness/flops.py GPU_PEAKS)"
        precision = "bf16" if bf16 else "tf32"
        return peaks[0] if bf16 else peaks[1], f"{name}, dense {precision} datasheet"
    threads = torch.get_num_threads()
    return threads * measured_cpu_peak(), (f"CPU: a float32 matmul measured here on one "
                                           f"thread, x {threads} thread(s) per rank")


def measured_cpu_peak(size: int = 512, repeats: int = 20) -> float:
    """The best FLOP/s of a float32 matmul on one thread: what one core does on the operation
    convolutions and linear layers come down to. One thread, best of many: a second thread
    would wait for whichever core another process holds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _best_matmul_rate(size, repeats)
    finally:
        torch.set_num_threads(threads)


def _best_matmul_rate(size: int, repeats: int) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
