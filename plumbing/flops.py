"""How much arithmetic a training step does, and how much of the hardware's peak that is (MFU).

Every step reports it through metrics.py: FLOP/s per rank in each epoch's line, and
`flops_per_sample`, `flops_per_sec_per_rank`, `peak_flops_per_rank` and `mfu` in summary.json.

- The FLOPs are counted, not estimated: torch.utils.flop_counter.FlopCounterMode runs one
  forward and backward of the model on the meta device (shapes only, no memory, no time) and
  adds up what each convolution and matmul costs. For this CNN that is about 72 MFLOP per
  training sample, 10 times the "6 x parameters" rule of thumb for transformers (1.2 M
  parameters x 6 = 7.2 MFLOP): that rule counts each weight once per sample, and a convolution
  applies each of its weights at every position of the image (conv2: 576 positions).
- The peak is a GPU's datasheet number for dense math in the precision the step computes in
  (bf16 with --amp, else TF32, which choose_device turns on), or on a CPU a float32 matmul
  measured here on one thread at the end of the run, times the rank's threads. MFU = achieved /
  peak. A small CNN fed from a DataLoader is far from its peak. For scale: nanoGPT's train.py
  prints MFU against an A100's 312 TFLOP/s bf16 peak, torchtitan logs it for its Llama runs,
  and the PaLM paper, which named the measure, reports 46 % for a 540 B-parameter model.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from .model import build_model

# Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, FLOP/s:
# (name fragment as torch.cuda.get_device_name() shows it, bf16, tf32). V100 and T4 have
# neither bf16 nor TF32: their fp32 peak stands in both columns.
GPU_PEAKS = [
    ("H200", 989e12, 494e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),  # SXM
    ("A100", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("A10", 125e12, 62.5e12),
    ("L4", 121e12, 60e12),
    ("V100", 15.7e12, 15.7e12),
    ("T4", 8.1e12, 8.1e12),
]


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
        for fragment, bf16_peak, tf32_peak in GPU_PEAKS:
            if fragment in name:
                precision = "bf16" if bf16 else "tf32"
                return (bf16_peak if bf16 else tf32_peak), f"{name}, dense {precision} datasheet"
        return None, f"{name}: peak unknown (add it to plumbing/flops.py GPU_PEAKS)"
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
