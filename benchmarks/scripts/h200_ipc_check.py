"""Does xelink's CUDA IPC work under this launch's GPU binding? A tiny check, one line per rank.

Run on 2+ GPUs of one host, one rank per GPU, under each binding to compare:

    launch_scripts/xelink-run -n 2 python3 benchmarks/scripts/h200_ipc_check.py                 # one GPU visible per rank
    launch_scripts/xelink-run --visible all -n 2 python3 benchmarks/scripts/h200_ipc_check.py   # every GPU visible

It maps peer memory (``xelink/symm/cuda.py``: cuIpcGetMemHandle / cuIpcOpenMemHandle) through the paths the
suite uses: a one-shot all-reduce (Triton kernel storing into the peers' scratch), a copy-engine
all-gather on ``xelink.empty`` tensors (DMA reads of peer memory) and a GPU barrier, and checks every
element. Prints ``IPC-CHECK OK`` on rank 0 when every rank got exact results; exit status 1 otherwise
(an exception names the failing call; the peer-memory error says what to change).
"""
import os
import sys

import torch

import xelink


def main() -> int:
    world = xelink.init(timeout=60)
    n, r = world.size, world.rank
    dev = torch.device(world.device)
    if dev.type != "cuda" or n < 2:
        print(f"rank {r}: IPC-CHECK needs 2+ ranks on CUDA GPUs (have {n} on {dev})", flush=True)
        xelink.finalize()
        return 1
    print(f"rank {r}: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')} "
          f"device_count={torch.cuda.device_count()} device={dev} name={torch.cuda.get_device_name(dev)}", flush=True)
    wrong = 0
    x = torch.full((4096,), float(r + 1), device=dev)
    xelink.all_reduce(x, algo="direct")
    xelink.synchronize()
    wrong += int((x != n * (n + 1) / 2).sum())
    shard = xelink.empty(1 << 20, dtype=torch.float32)
    shard.fill_(float(r))
    out = torch.empty(n << 20, device=dev)
    xelink.all_gather_into_tensor(out, shard, algo="copy_engine")
    xelink.device_barrier()
    xelink.synchronize()
    want = torch.arange(n, device=dev, dtype=torch.float32).repeat_interleave(1 << 20)
    wrong += int((out != want).sum())
    every = world.allgather_object(wrong)
    if r == 0:
        verdict = "IPC-CHECK OK" if not any(every) else f"IPC-CHECK WRONG: wrong elements per rank {every}"
        print(f"{verdict} ({n} ranks: direct all_reduce, copy_engine all_gather on xelink.empty, device barrier)",
              flush=True)
    xelink.finalize()
    return 1 if any(every) else 0


if __name__ == "__main__":
    sys.exit(main())
