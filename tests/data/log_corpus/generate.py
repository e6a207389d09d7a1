"""Writes the two log corpora the failure patterns are measured on (seeded: the output is stable).

benign.txt    lines a healthy training job prints: NCCL INFO lines, PyTorch and Python warnings,
              progress bars, loss logs, nvidia-smi and kernel information lines, and user prints
              and paths that contain "error", "ECC", "xid", "Xid", "fallen", "timeout", "fatal".
              None of them is a hardware error: a classifier must raise nothing for them.
hardware.txt  "<expected type>\\t<line>": real-format error lines of the NVIDIA kernel driver
              (NVRM Xid, fallen off the bus), DCGM, nvidia-smi, NVML, the CUDA runtime, the
              mlx5_core driver, NCCL and PyTorch, each labelled by hand with the type it must get
              (the Xid labels follow NVIDIA's Xid catalogue, written out here independently of
              transom.monitor.patterns).

    python tests/data/log_corpus/generate.py      # rewrites both files next to this script

Used by tests/test_patterns.py and benchmarks/detection/detection_bench.py; it must never
import transom.
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 15
GENERATED_BENIGN = 3000

HOSTS = ["gpu-node-01", "dgx-a100-17", "h100-r3-n12", "trn-7f3c", "worker-0", "ip-10-0-3-41"]
WORDS = ["error", "errors", "ECC", "ecc", "xid", "Xid", "XID", "fallen", "timeout", "fatal"]


def pci(rng: random.Random) -> str:
    return (
        f"0000:{rng.choice(['07', '0f', '18', '2a', '3b', '4a', '5e', '87', '9a', 'ba', 'db'])}:00"
    )


def benign_line(rng: random.Random) -> str:
    host, pid, tid = rng.choice(HOSTS), rng.randint(1000, 99999), rng.randint(1000, 99999)
    dev, rank, n = rng.randint(0, 7), rng.randint(0, 63), rng.randint(0, 5000)
    loss, lr = rng.uniform(0.5, 9.0), rng.uniform(1e-5, 3e-4)
    word = rng.choice(WORDS)
    nccl = f"{host}:{pid}:{tid} [{dev}] NCCL INFO "
    ts = (
        f"[W{rng.randint(1101, 1130)} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
        f"{rng.randint(0, 59):02d}.{rng.randint(0, 999999):06d} {pid}"
    )
    bar_done = rng.randint(0, 10)
    bar = "█" * bar_done + " " * (10 - bar_done)
    templates = [
        nccl + f"Bootstrap : Using eth0:10.0.{rng.randint(0, 9)}.{rng.randint(1, 254)}<0>",
        nccl + "NET/Plugin: No plugin found (libnccl-net.so)",
        nccl + "NET/Plugin: Plugin load returned 2 : libnccl-net.so: cannot open shared object "
        "file: No such file or directory : when loading libnccl-net.so",
        nccl + "NET/Plugin: Using internal network plugin.",
        nccl + f"cudaDriverVersion {rng.choice([12020, 12040, 12060])}",
        nccl + f"NCCL version 2.{rng.choice([18, 19, 20, 21])}.{rng.randint(1, 5)}+cuda12.4",
        nccl + "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB ; "
        f"OOB eth0:10.0.0.{rng.randint(1, 254)}<0>",
        nccl + "Using non-device net plugin version 0",
        nccl + rng.choice(["Using network IB", "Using network Socket"]),
        nccl + f"comm 0x{rng.getrandbits(40):x} rank {rank} nranks 64 cudaDev {dev} nvmlDev {dev} "
        f"busId {rng.choice(['18000', '2a000', '3b000', '9a000'])} commId 0x{rng.getrandbits(64):x}"
        f" - Init {rng.choice(['START', 'COMPLETE'])}",
        nccl + f"Setting affinity for GPU {dev} to ffff,ffffffff",
        nccl + f"NVLS multicast support is not available on dev {dev}",
        nccl + f"Channel {rng.randint(0, 31):02d}/32 :    0   1   2   3   4   5   6   7",
        nccl + f"Trees [0] {rng.randint(1, 7)}/-1/-1->{dev}->{rng.randint(0, 7)}",
        nccl + f"Channel {rng.randint(0, 31):02d}/0 : {dev}[{dev}] -> {(dev + 1) % 8}"
        f"[{(dev + 1) % 8}] via P2P/CUMEM/read",
        nccl + rng.choice(["Connected all rings", "Connected all trees", "Connected NVLS"]),
        nccl + "threadThresholds 8/8/64 | 512/8/64 | 512 | 512",
        nccl + "32 coll channels, 0 collnet channels, 16 nvls channels, 32 p2p channels",
        nccl + f"NCCL_IB_TIMEOUT set by environment to {rng.choice([18, 20, 22])}",
        nccl + f"NCCL_SOCKET_IFNAME set by environment to {rng.choice(['eth0', 'ens', '^lo'])}",
        nccl + "NCCL_DEBUG set by environment to INFO",
        nccl + f"Init timings: rank {rank} nranks 64 total {rng.uniform(0.5, 3):.2f} (kernels "
        f"0.15, bootstrap {rng.uniform(0.1, 1):.2f}, allgathers 0.02, topo 0.30, graphs 0.01, "
        "connections 0.30, rest 0.05)",
        nccl + f"[Proxy Service] Device {dev} CPU core {rng.randint(0, 127)}",
        nccl + f"comm 0x{rng.getrandbits(40):x} rank {rank} nranks 64 cudaDev {dev} busId 3b000 "
        "- Destroy COMPLETE",
        f"{ts} ProcessGroupNCCL.cpp:852] [PG 0 Rank {rank}] ProcessGroupNCCL initialization "
        f"options: size: 64, global rank: {rank}, TIMEOUT(ms): 600000, "
        "USE_HIGH_PRIORITY_STREAM: 0, SPLIT_FROM: 0, SPLIT_COLOR: 0, PG Name: 0",
        f"{ts} ProcessGroupNCCL.cpp:861] [PG 0 Rank {rank}] ProcessGroupNCCL environments: NCCL "
        "version: 2.20.5, TORCH_NCCL_ASYNC_ERROR_HANDLING: 3, TORCH_NCCL_DUMP_ON_TIMEOUT: 0, "
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: 60000, TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: 600",
        f"[rank{rank}]:{ts} ProcessGroupNCCL.cpp:4115] [PG ID 0 PG GUID 0 Rank {rank}]  using GPU "
        f"{dev} to perform barrier as devices used by this process are currently unknown. This "
        "can potentially cause a hang if this rank to GPU mapping is incorrect.",
        f"{ts} torch/distributed/run.py:793] Setting OMP_NUM_THREADS environment variable for "
        "each process to be 1 in default, to avoid your system being overloaded",
        f"{ts} socket.cpp:663] [c10d] The client socket has failed to connect to [localhost]:"
        f"{rng.randint(29000, 29999)} (errno: 99 - Cannot assign requested address).",
        "/usr/lib/python3/dist-packages/torch/_utils.py:831: UserWarning: TypedStorage is "
        "deprecated. It will be removed in the future and UntypedStorage will be the only "
        "storage class.",
        "FutureWarning: `torch.cuda.amp.GradScaler(args...)` is deprecated. Please use "
        "`torch.amp.GradScaler('cuda', args...)` instead.",
        f"/opt/conda/lib/python3.11/site-packages/torch/utils/checkpoint.py:{rng.randint(400, 500)}"
        ": UserWarning: torch.utils.checkpoint: the use_reentrant parameter should be passed "
        "explicitly.",
        "UserWarning: TensorFloat32 tensor cores for float32 matrix multiplication available but "
        "not enabled. Consider setting `torch.set_float32_matmul_precision('high')`",
        "UserWarning: Plan failed with a cudnnException: CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: "
        "cudnnFinalize Descriptor Failed cudnn_status: CUDNN_STATUS_NOT_SUPPORTED (Triggered "
        "internally at ../aten/src/ATen/native/cudnn/Conv_v8.cpp:919.)",
        "  warnings.warn(",
        f"DeprecationWarning: the {word} argument is deprecated and will be removed in v2.0",
        f"RuntimeWarning: invalid value encountered in divide (column '{word}_rate')",
        "FutureWarning: You are using `torch.load` with `weights_only=False`.",
        f"Epoch {rng.randint(0, 9)}: {bar_done * 10:3d}%|{bar}| {n}/5000 [{rng.randint(0, 59):02d}"
        f":{rng.randint(0, 59):02d}<{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}, "
        f"{rng.uniform(1, 40):.2f}it/s, loss={loss:.3f}, {word}={rng.randint(0, 3)}]",
        f"Evaluating: {bar_done * 10:3d}%|{bar}| {n}/5000 [00:12<00:15, 36.1it/s]",
        f"Map (num_proc=8): {bar_done * 10:3d}%|{bar}| {n}/5000 [00:02<00:00, 4102.12 examples/s]",
        f"Downloading shards: {bar_done * 10:3d}%|{bar}| {bar_done}/10 [00:0{bar_done}<00:00]",
        f"step {n} loss {loss:.4f} lr {lr:.2e} grad_norm {rng.uniform(0.1, 3):.3f}",
        f"step {n} loss {loss:.4f} t={rng.uniform(0, 9999):.3f}",
        f"epoch {rng.randint(0, 30)} | train loss {loss:.3f} | val loss {loss + 0.1:.3f} | "
        f"error rate {rng.uniform(0, 0.5):.2%}",
        f"validation error: {rng.uniform(0, 1):.4f} (best {rng.uniform(0, 1):.4f})",
        f"top-1 error {rng.uniform(5, 40):.2f}%, top-5 error {rng.uniform(1, 10):.2f}%",
        f"relative error {rng.uniform(1e-8, 1e-5):.2e} within tolerance",
        f"{rng.randint(0, 3)} ECC errors",
        f"GPU health check: {rng.randint(0, 2)} ECC errors, 0 retired pages, xid=0, temp "
        f"{rng.randint(30, 80)}C",
        f"ECC errors: {rng.randint(0, 9)} corrected, 0 uncorrected (fine)",
        f"ecc={rng.randint(0, 1)} xid={rng.randint(0, 1)} thermal=ok util={rng.randint(0, 100)}%",
        f"xid {rng.randint(0, 99)} column",
        f"loading column xid_{rng.randint(0, 40)} from table events_{n}",
        f"feature 'xid' has {n} unique values; dropping it",
        f"Xid {rng.randint(1, 200)}: {rng.choice(['user', 'session', 'row'])} id in the dataset",
        f"user Xid{n} joined the run",
        f"XID lookup: {n} records, {rng.randint(0, 5)} errors",
        f"the loss has fallen to {loss:.3f}",
        f"throughput has fallen by {rng.uniform(0.1, 9):.1f}% since step {n}",
        f"{rng.randint(1, 999)} leaves have fallen; tree {n} pruned",
        f"setting NCCL timeout to {rng.choice([600, 1800, 3600])} s",
        f"DataLoader(num_workers=8, timeout={rng.choice([0, 60, 120])})",
        f"request timed out after {rng.randint(1, 60)}s, retrying ({rng.randint(1, 3)}/3)",
        f"WARNING:root:Timeout while waiting for the metrics server; continuing (step {n})",
        f"no error at step {n}",
        f"errors: 0, warnings: {rng.randint(0, 9)}",
        f"error=None status=ok step={n}",
        f"Error: none ({word} check passed)",
        f"checked {n} files: 0 errors, 0 fatal",
        f"not fatal: skipped {rng.randint(1, 9)} corrupt samples in shard {n}",
        f"mlx5_core 0000:{rng.choice(['3b', '5e', '87'])}:00.0: no error",
        f"/datasets/ecc_errors_2023/train-{n:05d}-of-05000.parquet",
        f"reading /data/xid_logs/shard_{n}.jsonl",
        f"saving checkpoint to /mnt/fallen_off_the_bus/ckpt/step_{n}",
        f"wrote /home/user/nccl_error_analysis/run_{n}/metrics.csv",
        f"s3://bucket/timeout-study/part-{n:05d}.tar",
        f"/checkpoints/run-error-free/step_{n}/model.safetensors saved",
        f"CUDA available: True, devices: {rng.choice([1, 2, 4, 8])}",
        f"CUDA_VISIBLE_DEVICES={','.join(str(i) for i in range(rng.randint(1, 8)))}",
        f"no OOM at batch size {rng.choice([8, 16, 32, 64])}; max memory allocated "
        f"{rng.uniform(1, 79):.1f} GiB",
        f"iteration {n}/100000 | consumed samples: {n * 512} | elapsed time per iteration (ms): "
        f"{rng.uniform(300, 900):.1f} | learning rate: {lr:.3E} | global batch size: 512 | "
        f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {rng.uniform(0, 2):.3f} | "
        "number of skipped iterations: 0 | number of nan iterations: 0 |",
        f"[2024-11-30 10:00:00,123] [INFO] [logging.py:96:log_dist] [Rank 0] step={n}, skipped=0,"
        f" lr=[{lr:.6f}], mom=[(0.9, 0.95)]",
        f"{{'loss': {loss:.4f}, 'grad_norm': {rng.uniform(0, 3):.3f}, 'learning_rate': {lr:.2e},"
        f" 'epoch': {rng.uniform(0, 3):.2f}}}",
        f"2024-11-30 10:00:00,123 - INFO - eval: exact_match={rng.uniform(0, 1):.3f}, "
        f"error_rate={rng.uniform(0, 1):.3f}",
        f"wandb:   train/{word} {rng.uniform(0, 1):.5f}",
        "wandb: Run summary:",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
        f"nvidia-nvswitch: Probing device 0000:{rng.choice(['05', '06', '07', '08'])}:00.0",
        f"| N/A   {rng.randint(25, 60)}C    P0    {rng.randint(60, 700)}W /  700W |   "
        f"{rng.randint(4, 80000)}MiB / 81559MiB |   {rng.randint(0, 100)}%   Default |",
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. "
        "ECC |",
        f"|   {dev}  NVIDIA H100 80GB HBM3          On  | 00000000:{rng.choice(['18', '2A'])}:00.0"
        " Off |                    0 |",
        f"            SRAM {rng.choice(['Correctable', 'Uncorrectable'])}              : 0",
        f"            DRAM {rng.choice(['Correctable', 'Uncorrectable'])}              : 0",
        f"        {rng.choice(['Correctable Error', 'Uncorrectable Error'])}                 : 0",
        "        Remapping Failure Occurred        : No",
        "        Pending                           : No",
        f"mlx5_core {pci(rng)}.0: firmware version: 28.39.{rng.randint(1000, 2000)}",
        f"mlx5_core {pci(rng)}.0: Rate limit: 127 rates are supported, range: 0Mbps to 195312Mbps",
        f"mlx5_core {pci(rng)}.0 ibp{rng.randint(20, 200)}s0: Link up",
        f"mlx5_core {pci(rng)}.0: Port module event: module {rng.randint(0, 3)}, Cable plugged",
        f"mlx5_core {pci(rng)}.0: E-Switch: Total vports 18, per vport: max uc(1024) max mc(16384)",
        f"mlx5_core {pci(rng)}.0: MLX5E: StrdRq(1) RqSz(8) StrdSz(2048) RxCqeCmprss(0 basic)",
        f"[train_gpt] resumed step={n} rank={rank}",
        f"print: the {word} handler returned OK for batch {n}",
        f"{word}: 0",
        f"{word.upper()} counters look fine on all {rng.choice([4, 8])} GPUs",
        f"Retrying after {word} in data loader worker {rng.randint(0, 15)} (attempt 1)",
        f"Note: Xid {rng.choice([13, 31, 43, 48, 79])} would mean trouble; none seen",
        f"simulated {word} injected into unit test {n}: passed",
    ]
    return rng.choice(templates)


# Hand-written lines a healthy job may print; the generator's templates cannot express them all.
BENIGN_BY_HAND = [
    "0 ECC errors",
    "xid 42 column",
    "mlx5_core 0000:5e:00.0: no error",
    "No ECC errors detected in the last 24 hours.",
    "The GPU has not fallen off the bus.",
    "if you see 'GPU has fallen off the bus' in dmesg, reseat the card",
    "Checking for Xid errors... none",
    "grep -i xid /var/log/syslog returned nothing",
    "Uncorrectable ECC: 0, Correctable ECC: 12",
    "ECC mode: Enabled",
    "timeout: the monitored command dumped core? no, exited 0",
    "fatal: not a git repository (or any of the parent directories): .git",
    "error: pathspec 'main' did not match any file(s) known to git",
    "Error loading optional plugin foo; continuing without it",
    "nccl warn: this is a lowercase user message, not NCCL",
    "NCCL INFO NET/IB : Got completion stats: 0 errors",
    "ib0: link up (the IB link is fine)",
    "IB port link down? No: port state ACTIVE",
    "The mlx5 fatal-error handler test passed",
    "Traceback suppressed: handled KeyError in the data collator (expected)",
    "CUDA error checks enabled: TORCH_USE_CUDA_DSA=1",
    "no CUDA out of memory this run",
    "OutOfMemoryError handler registered",
    "Xid (PCI) counters reset by the admin",
    "NVRM Xid parsing demo: see docs",
    "Detected 0 problems in GPU 0.",
    "GPU 0 had no uncorrectable memory errors",
    "ProcessGroupNCCL watchdog thread started",
    "[rank0]: loss 2.31 (no error, no timeout)",
    "[rank7]: error bars: ±0.03",
    "Epoch 3 finished: fallen_angels accuracy 0.91, error 0.09",
    "xid=79 is a column name in the churn dataset",
    "DCGM health: Healthy",
    "dcgmi diag -r 1: Pass",
    "nvidia-smi -q -d ECC | grep -i volatile",
    "Volatile Uncorr. ECC : 0",
    "Aggregate Uncorr. ECC : 0",
    "Retired Pages: Single Bit ECC: 0, Double Bit ECC: 0, Pending: No",
    "warning: ECC disabled on GPU 3 (consumer card), continuing",
    "User requested timeout of 30 minutes for the barrier",
    "Connection timeout=30s, read timeout=60s",
    "Saved errors.json (0 entries) to /tmp/run/errors.json",
    "fallen: 0, risen: 12",
    "cublas status: CUBLAS_STATUS_SUCCESS",
    "[gloo] rank 0 connected to rank 1",
    "gloo: using transport tcp",
    "mlx5_core 0000:5c:00.0: mlx5_cmd_out_err:838:(pid 2231): ACCESS_REG(0x805) op_mod(0x0) "
    "failed, "
    "status bad operation(0x2), syndrome (0x30dd14), err(-22)",
    "mlx5_core 0000:41:00.1: Port module event: module 1, Cable unplugged",
    "mlx5_core 0000:41:00.0 enp65s0f0np0: renamed from eth0",
    "NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
    "NVRM: NVLink link training completed",
]


HARDWARE_XID_TEXT = {
    46: "GPU stopped processing",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at "
    "partition 2, subpartition 1.",
    54: "Auxiliary power is not connected to the GPU board",
    62: "Internal micro-controller halt",
    63: "Row Remapper: New row (0x00000000001f7c00) marked for remapping, reset gpu to activate.",
    64: "Row Remapper Error: New row (0x00000000000a1b40) could not be marked for remapping",
    74: "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 "
    "(GSP_RM_CONTROL) (0x20800a4c 0x4).",
    120: "GSP task exception: (pc=0x2fd98, ra=0x0) (cause 0x5, status 0x5)",
    140: "An uncorrectable ECC error detected (possible firmware handling failure)",
}
APPLICATION_XID_TEXT = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ "
    "0x7f12_3400_0000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000010",
    45: "Ch 00000012",
}


def hardware_lines(rng: random.Random) -> list[tuple[str, str]]:
    """(expected type, line): generated Xid variants plus hand-written lines of other sources."""
    out: list[tuple[str, str]] = []
    prefixes = ["", "[ 8123.456789] ", "kernel: ", "Nov 30 10:02:11 gpu-node-01 kernel: "]
    for table, type_ in ((HARDWARE_XID_TEXT, "xid"), (APPLICATION_XID_TEXT, "xid_app")):
        for xid, text in table.items():
            for _ in range(2):
                bus = pci(rng)
                who = rng.choice(
                    [
                        f"pid={rng.randint(100, 99999)}, name=python",
                        f"pid={rng.randint(100, 99999)}, name=pt_main_thread",
                        "pid='<unknown>', name=<unknown>",
                        f"pid={rng.randint(100, 99999)}",
                    ]
                )
                out.append(
                    (type_, f"{rng.choice(prefixes)}NVRM: Xid (PCI:{bus}): {xid}, {who}, {text}")
                )
    out += [
        ("xid", "NVRM: Xid (0000:03:00): 48, An uncorrectable double bit error (DBE) detected"),
        ("xid", "Detected XID 79 for GPU 3"),
        ("xid", "Detected XID 48 for GPU 0"),
        ("xid_app", "Detected XID 13 for GPU 5"),
        ("xid_other", "NVRM: Xid (PCI:0000:3b:00): 8, pid=2231, name=python, Channel 0x00000038"),
        ("gpu_lost", "NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus."),
        ("gpu_lost", "[ 9921.004411] NVRM: GPU 0000:9a:00.0: GPU has fallen off the bus."),
        ("gpu_lost", "NVRM: GPU at PCI:0000:db:00: GPU has fallen off the bus."),
        (
            "gpu_lost",
            "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost.  Reboot "
            "the system to recover this GPU",
        ),
        ("gpu_lost", "Unable to determine the device handle for GPU0000:87:00.0: Unknown Error"),
        ("gpu_lost", "pynvml.NVMLError_GpuIsLost: GPU is lost"),
        ("ecc", "RuntimeError: CUDA error: uncorrectable ECC error encountered"),
        (
            "ecc",
            "gpu-node-01:2231:2290 [3] NCCL WARN Cuda failure 'uncorrectable ECC error "
            "encountered'",
        ),
        ("ecc", "cudaErrorECCUncorrectable returned by cudaStreamSynchronize"),
        ("ecc", "Detected 2 volatile double-bit ECC error(s) in GPU 1."),
        ("ecc", "Detected 17 volatile double-bit ECC error(s) in GPU 6."),
        ("ecc", "GPU 4 had uncorrectable memory errors and row remapping failed."),
        ("ecc", "GPU 2 had uncorrectable memory errors and 3 rows were remapped"),
        ("ecc", "GPU had an uncontained error (XID 95)"),
        ("ecc", "Pending page retirements together with a DBE were detected on GPU 7."),
        ("ib_error", "mlx5_core 0000:3b:00.0: poll_health:801:(pid 0): Fatal error 1 detected"),
        (
            "ib_error",
            "[ 5521.118822] mlx5_core 0000:5e:00.0: poll_health:694:(pid 0): Fatal error 3 "
            "detected",
        ),
        ("ib_error", "kernel: mlx5_core 0000:5e:00.0: fatal error detected"),
        (
            "ib_error",
            "mlx5_core 0000:87:00.0: poll_health:713:(pid 0): device's health compromised - "
            "reached miss count",
        ),
        (
            "ib_error",
            "mlx5_core 0000:ba:00.0: mlx5_pci_err_detected Device state = 1 health sensors: 1 "
            "pci_status: 1. Enter, pci channel state = 2",
        ),
        ("ib_error", "mlx5_core 0000:3b:00.0: mlx5_enter_error_state:121:(pid 1117): start"),
        (
            "ib_error",
            "mlx5_core 0000:3b:00.0: mlx5_handle_bad_state:276:(pid 1117): starting teardown",
        ),
        (
            "ib_error",
            "mlx5_core 0000:1a:00.0: Port module event[error]: module 0, Cable error, High "
            "Temperature",
        ),
        ("ib_error", "mlx5_core 0000:3b:00.0 ibp59s0: Link down"),
        (
            "ib_error",
            "mlx5_core 0000:5c:00.0: mlx5_pcie_event:299:(pid 5512): Detected insufficient power "
            "on the PCIe slot (27W).",
        ),
        ("gpu_lost", "NVRM: fallen off the bus and is not responding to commands."),
        ("gpu_lost", "NVRM: GPU 18:00.0: GPU has fallen off the bus."),
        ("ib_error", "mlx5_core 0000:4a:00.1 enp74s0f1np1: Link down"),
        (
            "nccl_error",
            "gpu-node-01:2231:2290 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<34567>"
            " with status=12 opcode=0 len=0 vendor err 129 (Send) localGid ::ffff:10.0.0.1 "
            "remoteGids::ffff:10.0.0.2 hca mlx5_0",
        ),
        (
            "nccl_error",
            "dgx-a100-17:99812:99870 [5] NCCL WARN NET/IB : Got completion with error 12, opcode "
            "0, len 0, vendor err 129",
        ),
        ("nccl_error", "NCCL WARN NET/IB : Got completion with error 12"),
        (
            "nccl_error",
            "h100-r3-n12:7712:7790 [2] NCCL WARN Call to ibv_modify_qp failed with error "
            "Connection timed out",
        ),
        (
            "nccl_error",
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
            "ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for "
            "details), NCCL version 2.20.5",
        ),
        (
            "nccl_error",
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed "
            "or device error.",
        ),
        (
            "nccl_error",
            "[rank3]:[E1130 10:12:13.000000 2231 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught"
            " collective operation timeout: WorkNCCL(SeqNum=1234, OpType=ALLREDUCE, NumelIn=1, "
            "NumelOut=1, Timeout(ms)=600000) ran for 600032 milliseconds before timing out.",
        ),
        (
            "cuda_error",
            "RuntimeError: CUDA error: an illegal memory access was encountered",
        ),
        ("cuda_error", "RuntimeError: CUDA error: device-side assert triggered"),
        (
            "cuda_error",
            "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`",
        ),
        (
            "oom",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 79.11 GiB of which 1.02 GiB is free.",
        ),
        (
            "oom",
            "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 1073741824 bytes.",
        ),
        ("oom", "OSError: [Errno 12] Cannot allocate memory"),
    ]
    return out


def corpora() -> tuple[list[str], list[tuple[str, str]]]:
    """(benign lines, (expected type, line) hardware rows): what the two files hold."""
    rng = random.Random(SEED)
    benign = [benign_line(rng) for _ in range(GENERATED_BENIGN)] + BENIGN_BY_HAND
    return benign, hardware_lines(rng)


def main() -> None:
    benign, hardware = corpora()
    (HERE / "benign.txt").write_text("\n".join(benign) + "\n")
    (HERE / "hardware.txt").write_text("".join(f"{t}\t{line}\n" for t, line in hardware))
    print(f"benign.txt: {len(benign)} lines; hardware.txt: {len(hardware)} lines")


if __name__ == "__main__":
    main()
