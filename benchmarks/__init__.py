"""Benchmarks of the HN-CLIP loss: one command, on a GPU or a CPU.

    python -m benchmarks.run [--device auto|cpu|cuda] [--quick] [--out DIR]
                             [--sizes N,..] [--dims D,..] [--dtypes ..] [--modes fwd,bwd,fwd+bwd]
                             [--providers ..] [--threads T]

Providers: hnclip-triton (ours, CUDA), hnclip-cpp (ours, CPU), hnclip-torch (our pure-PyTorch
backend, eager), hnclip-torch-compile (torch.compile of it), all at γ = 0.5; open_clip
(ClipLoss), inf-cl (cal_inf_loss both ways) and memeff (MemoryEfficientCLIPLoss), plain
InfoNCE (γ = 0). τ = 0.07 throughout. A provider that cannot run here (not importable,
wrong device, C++ extension not built) is printed as skipped and recorded in the CSV as one
row per cell with status "skipped: <reason>" and empty measured columns.

Per cell (provider, dtype, N, D, mode):
  * mode: fwd (forward with autograd recording, as in training), bwd (backward only; its
    forward runs untimed), fwd+bwd.
  * median_ms, q20_ms, q80_ms: GPU: triton.testing.do_bench (warm-up, L2 flushed between
    runs, 3 input sets rotated) or, for bwd and for calls too slow for do_bench, the same
    CUDA-event loop; CPU: time.perf_counter over repeated calls after a warm-up call.
  * peak_mem_mb (MiB): peak above what is live at the start of one timed call (the inputs;
    for bwd also the saved forward graph). GPU: torch.cuda.max_memory_allocated. CPU: growth
    of the resident set (VmHWM reset through /proc/self/clear_refs), each provider in its own
    worker process so that providers do not share a heap.
  * workspace_mb (MiB): for the hnclip-triton providers, what ``hnclip_kernels.workspace_bytes``
    states the fused path allocates beyond inputs and outputs (the forward's partial
    statistics plus the backward's dS chunks, GPU launch configuration), beside the measured
    peak, which also holds the outputs, the float32 gradients and the epilogue's temporaries;
    "n/a" for the other providers.
  * tflops: useful FLOPs (2·N²·D fwd, 4·N²·D bwd, 6·N²·D fwd+bwd) per second, the same count
    for every provider; frac_of_matmul: tflops / matmul_tflops, the dense torch.matmul rate
    measured in the same run (bf16 on a GPU, float32 with the benchmark's threads on a CPU).
  * status: "ok"; "OOM" (the provider ran out of memory: always tried, never predicted;
    caught, the sweep goes on); "skipped: <reason>" (unavailable provider, or a cell whose
    time, predicted from the same provider's last measured size as ∝ N²·D, exceeds
    --max-call-s per call or the --budget-s time budget that keeps the default GPU sweep
    under 4 minutes); "error: <exception>".
The measured columns are filled exactly when status is "ok".

Sweep order: the smallest N of every dtype first (it pays every compilation), then the
dtypes in --dtypes order (bfloat16 first on a GPU) with growing N, so a tight budget drops
the largest float32 cells first. Large calls are timed 3 times (after a warm-up at a
smaller N), so the slowest cells cost about 3 calls each.

Outputs under --out (default benchmarks/out): DEVICE_results.csv, DEVICE_time_vs_n.png,
DEVICE_memory_vs_n.png, and the table (with time ratios against hnclip-triton on a GPU,
hnclip-cpp on a CPU, falling back to hnclip-torch) on stdout.

The sigmoid (SigLIP) loss runs through the same command with ``--loss sigmoid`` (its providers,
hnclip-cpp/-triton at γ = 0.5 and 0, hnclip-torch, open_clip's SigLipLoss and siglip-kernel, in
``benchmarks/sigmoid.py``); it writes DEVICE_sigmoid_results.csv and DEVICE_sigmoid_*.png.

The hard-negative loss against the number of negative captions M (with NegCLIP's plain
N × (N + M) logits as a provider) has its own command: ``python -m benchmarks.negatives``
(``benchmarks/negatives.py``).
"""
