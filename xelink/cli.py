"""The ``xelink`` command: ``xelink info``, ``xelink demo``, ``xelink topology``, ``xelink cost`` and ``xelink bench``.

Run under a launcher (``mpiexec -n 4 xelink info``) to see every rank; rank 0 prints.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys

from .config import at_least, opencl_runtime_default, run_reporting_settings

__all__ = ["main", "collect_info"]


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return str(getattr(mod, "__version__", "installed"))


def _mpi_library(in_use: bool) -> str | None:
    if not in_use:
        # Importing mpi4py.MPI initialises MPI; outside an MPI launch, report the package only.
        version = _version("mpi4py")
        return f"mpi4py {version} (not used by this launch)" if version else None
    from .transport.mpi import mpi

    MPI = mpi()  # (under the watchdog of MPI_Init)
    # Open MPI ends the string with a NUL byte.
    return " ".join(MPI.Get_library_version().split("\n")[0].replace("\x00", "").split())


def _devices() -> dict:
    import torch

    opencl_runtime_default()  # before anything loads a SYCL runtime (dpctl, xelink.sycl see the CPU device then)
    out = {"cuda": [], "xpu": [], "sycl": None}
    if torch.cuda.is_available():
        out["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        out["xpu"] = [torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count())]
    try:
        import dpctl
    except ImportError:
        pass
    else:
        out["sycl"] = [d.filter_string + " " + d.name for d in dpctl.get_devices()]
    return out


def _transports(world) -> dict:
    import torch.distributed as dist

    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                ("xccl", getattr(dist, "is_xccl_available", lambda: False)())) if ok]
    return {
        "in_use": world.transport.name,
        "mpi": _mpi_library(world.transport.name == "mpi"),
        "torch.distributed": backends,
    }


def collect_info(world) -> dict:
    """What this rank knows about itself: versions, launch, device, transports."""
    import torch

    launch = world.launch
    devices = _devices()  # (first: importing dpctl for its version would load its runtime before OpenCL is set up)
    return {
        "rank": world.rank,
        "host": world.host,
        "launcher": launch.launcher,
        "local_rank": launch.local_rank,
        "local_size": launch.local_size,
        "device": str(world.device),
        "versions": {
            "xelink": _version("xelink"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": _version("numpy"),
            "mpi4py": _version("mpi4py"),
            "triton": _version("triton"),
            "dpctl": _version("dpctl"),
        },
        "devices_visible": devices,
        "transports": _transports(world),
    }


def _print_topology_summary(world) -> None:
    topo, placement = world.topology, world.world_placement
    print(f"topology: {topo.name} ({topo.description}); {len(topo.devices)} device(s) in "
          f"{len(topo.packages)} package(s), {len(topo.links)} link(s); `xelink topology` prints it")
    for group in placement.packages():
        dev = placement.device(group[0])
        print(f"  package {dev.package}: rank(s) {', '.join(map(str, group))}")


def _print_info(infos: list, world) -> None:
    first = infos[0]
    print("xelink", first["versions"]["xelink"])
    print("versions:", ", ".join(f"{k} {v}" for k, v in first["versions"].items() if v and k != "xelink"))
    print(f"launcher: {first['launcher']}, {world.size} rank(s), timeout {world.timeout:g} s")
    t = first["transports"]
    print(f"transports: host transport in use: {t['in_use']}; MPI: {t['mpi'] or 'not installed'}; "
          f"torch.distributed backends: {', '.join(t['torch.distributed']) or 'none'}")
    d = first["devices_visible"]
    print(f"devices visible on {first['host']}: cuda {d['cuda'] or 'none'}; xpu {d['xpu'] or 'none'}; "
          f"sycl {d['sycl'] if d['sycl'] is not None else 'dpctl not installed'}")
    hosts = {}
    for i in infos:
        hosts.setdefault(i["host"], []).append(i)
    _print_topology_summary(world)
    for host, ranks in hosts.items():
        print(f"  host {host}:")
        for i in ranks:
            print(f"    rank {i['rank']:>3}  local {i['local_rank']}/{i['local_size']}  device {i['device']}")


def _cmd_info(args) -> int:
    import xelink

    world = xelink.init()  # discovers the topology (or loads XELINK_TOPOLOGY) and places the ranks
    infos = world.allgather_object(collect_info(world))
    if world.rank == 0:
        if args.json:
            print(json.dumps(infos, indent=2))
        else:
            _print_info(infos, world)
    xelink.finalize()
    return 0


def _cmd_demo(args) -> int:
    """All-reduce a small tensor through torch.distributed on xelink's communicator and check it."""
    import torch
    import torch.distributed as dist

    import xelink

    world = xelink.init()
    x = torch.arange(args.n, dtype=torch.float64, device=world.device) + world.rank
    dist.all_reduce(x, group=world.process_group())
    n = world.size
    expect = n * torch.arange(args.n, dtype=torch.float64) + n * (n - 1) / 2
    ok = torch.equal(x.cpu(), expect)
    oks = world.allgather_object(ok)
    if world.rank == 0:
        print(f"all_reduce over {n} rank(s) ({world.launch.launcher}, device {world.device}): {x.cpu().tolist()}")
        print("correct on every rank" if all(oks) else f"WRONG on ranks {[r for r, o in enumerate(oks) if not o]}")
    xelink.finalize()
    return 0 if all(oks) else 1


def _cmd_topology(args) -> int:
    """Print a shipped, given or discovered topology; optionally save it as TOML."""
    from . import topology

    world = None
    if args.name:
        topo = topology.load(args.name)
    else:
        import xelink

        world = xelink.init()
        # init() already found the world's topology (XELINK_TOPOLOGY or discovery); --discover redoes it.
        topo = topology.discover(world) if args.discover else world.topology
    if world is None or world.rank == 0:
        print(topology.describe(topo))
        if args.save:
            topology.save(topo, args.save)
            print(f"saved to {args.save}")
    if world is not None:
        import xelink

        xelink.finalize()
    return 0


def _cmd_cost(args) -> int:
    """Print the cost model's predicted time of every algorithm per size, and its ratio to the ring (for a
    distributed GEMM op: per shape, and its share of GEMM-alone speed)."""
    from . import cost, topology

    try:  # usage errors before any launch
        shapes = [cost.parse_shape(s) for s in args.shapes] if args.op in cost.DIST_GEMM_OPS else []
        sizes = [cost.parse_size(s) for s in args.sizes]
    except ValueError as exc:
        print(f"xelink cost: {exc}", file=sys.stderr)
        return 2
    world = None
    if args.topology:
        topo = topology.load(args.topology)
    else:
        import xelink

        world = xelink.init()
        topo = world.topology
    nranks = len(topo.devices) if args.nranks is None else args.nranks
    ops = cost.OPS if args.op == "all" else (args.op,)
    if world is None or world.rank == 0:
        if args.op == "cp_attention":
            print(cost.cp_attention_table(topo, nranks, args.seq_lens, heads=args.heads, kv_heads=args.kv_heads,
                                          head_dim=args.head_dim, causal=args.causal, dtype_bytes=args.dtype_bytes))
        elif args.op in cost.DIST_GEMM_OPS:
            print(cost.dist_gemm_table(topo, nranks, args.op, shapes, args.dtype_bytes,
                                       gemm_tflops=args.gemm_tflops))
        else:
            print("\n\n".join(cost.table(topo, nranks, op, sizes) for op in ops))
    if world is not None:
        import xelink

        xelink.finalize()
    return 0


def _cost_ops() -> tuple:
    from .cost import DIST_GEMM_OPS, OPS

    return OPS + DIST_GEMM_OPS + ("cp_attention",)


def _generate_tp(world, cp: int) -> int:
    """The default TP size: the ranks of one package (TP's all-reduces stay on its links) when the packages are
    of one size that divides ``world.size // cp``, else ``world.size // cp``."""
    sizes = {len(p) for p in world.packages}
    pkg = sizes.pop() if len(sizes) == 1 else 0
    per = world.size // cp
    return pkg if pkg and per % pkg == 0 else per


def _chat_ids(folder, prompt: str):
    """(token ids, tokenizer) of ``prompt`` as a user's turn in the folder's chat template, as transformers'
    ``apply_chat_template(..., add_generation_prompt=True)`` writes it; else (None, why)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None, "needs the transformers package (pip install transformers) for the folder's chat template"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        return None, f"could not load the folder's tokenizer: {e}"
    if not getattr(tokenizer, "chat_template", None):
        return None, (f"needs a chat template in {folder} (tokenizer_config.json or chat_template.jinja); this "
                      f"folder has none")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids), tokenizer


def _cmd_generate(args) -> int:
    """Load a Hugging Face folder across the ranks (TP groups of consecutive ranks, inside a package by default;
    CP groups strided by the TP size; the rest replicas) and continue a prompt."""
    import time
    from pathlib import Path

    import torch

    import xelink
    from xelink.models import Llama

    ids, tokenizer = None, None
    for name in ("tp", "cp"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"xelink generate: --{name} {v} must be >= 1", file=sys.stderr)
            return 2
    if args.chat and args.prompt is None:
        print("xelink generate: --chat takes --prompt (text), not --prompt-ids", file=sys.stderr)
        return 2
    if args.chat:
        ids, got = _chat_ids(args.model, args.prompt)
        if ids is None:  # got: why
            print(f"xelink generate: --chat {got}", file=sys.stderr)
            return 2
        tokenizer = got
    elif args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            ids = []
        if not ids:
            print(f"xelink generate: --prompt-ids {args.prompt_ids!r} must be comma-separated token ids, e.g. 1,2,3",
                  file=sys.stderr)
            return 2
    else:
        if not (Path(args.model) / "tokenizer.json").exists():
            print(f"xelink generate: --prompt needs {Path(args.model) / 'tokenizer.json'}; this folder has none "
                  f"(pass --prompt-ids 1,2,3)", file=sys.stderr)
            return 2
        try:
            from tokenizers import Tokenizer
        except ImportError:
            print("xelink generate: --prompt needs the `tokenizers` package (pip install tokenizers), or pass "
                  "--prompt-ids", file=sys.stderr)
            return 2
        tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
        ids = tokenizer.encode(args.prompt).ids
        if not ids:
            print(f"xelink generate: --prompt {args.prompt!r} gives no tokens", file=sys.stderr)
            return 2
    world = xelink.init()
    tp = args.tp or _generate_tp(world, args.cp)
    if tp < 1 or world.size % (tp * args.cp):
        if world.rank == 0:
            print(f"xelink generate: --tp {tp} x --cp {args.cp} does not tile {world.size} rank(s)", file=sys.stderr)
        xelink.finalize()
        return 2
    # replicas x CP x TP, row-major: TP groups of consecutive ranks, CP groups strided by the TP size
    mesh = xelink.init_device_mesh(torch.device(world.device).type, (world.size // (tp * args.cp), args.cp, tp),
                                   mesh_dim_names=("replica", "cp", "tp"))
    tp_group, cp_group = mesh.get_group("tp"), mesh.get_group("cp") if args.cp > 1 else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    try:  # the checks made before any work: every rank raises the same
        model = Llama.from_pretrained(args.model, tp_group=tp_group, cp_group=cp_group, dtype=dtype,
                                      weights=args.weights, max_seq_len=args.max_seq_len, impl=args.impl,
                                      quantize_head=args.quantize_head)
        load_s = time.perf_counter() - t0
        out = model.generate(torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                             top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                             repetition_penalty=args.repetition_penalty, min_new_tokens=args.min_new_tokens)
    except (ValueError, TypeError, FileNotFoundError) as e:
        if world.rank == 0:
            print(f"xelink generate: {e}", file=sys.stderr)
        xelink.finalize()
        return 2
    new = out[0, len(ids):].tolist()
    t = model.last_timings
    cp_note = f", CP {args.cp}" if args.cp > 1 else ""
    replicas = world.size // (tp * args.cp)
    rep_note = f", {replicas} replicas" if replicas > 1 else ""
    if world.rank == 0:
        print(f"model {args.model}: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
              f"{world.size} rank(s), TP {tp}{cp_note}{rep_note}, weights {args.weights}"
              f"{' (the head too)' if args.quantize_head else ''}, {args.dtype}, device "
              f"{model.device}, loaded in {load_s:.2f} s")
        print(f"prompt ({len(ids)} tokens): {ids}")
        print(f"new tokens ({len(new)}): {new}")
        if tokenizer is not None:  # a chat's text without its special tokens (the end of the turn)
            print("text:", tokenizer.decode(new, skip_special_tokens=True) if args.chat else tokenizer.decode(new))
        if t:
            print(f"time to first token: {t['ttft_s'] * 1e3:.1f} ms; time per output token: {t['tpot_s'] * 1e3:.1f} ms")
    xelink.finalize()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # The command line is the one place outside xelink/bench that reaches the suite (the suite sits
        # above the library; nothing of the library imports it).
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="xelink", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="versions, launcher, devices, transports and topology")
    p.add_argument("--json", action="store_true", help="print every rank's record as JSON")
    p.set_defaults(fn=_cmd_info)
    p = sub.add_parser("demo", help="all-reduce a small tensor on every rank and check the result")
    p.add_argument("-n", type=at_least(0), default=8, help="elements (default 8)")
    p.set_defaults(fn=_cmd_demo)
    p = sub.add_parser("topology", help="print a topology (shipped, from XELINK_TOPOLOGY, or discovered)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--name", help="a shipped topology name or a .toml path (default: XELINK_TOPOLOGY, "
                                  "else discovery)")
    g.add_argument("--discover", action="store_true", help="discover from the running job (ignores XELINK_TOPOLOGY)")
    p.add_argument("--save", metavar="PATH", help="also write the topology as TOML to PATH")
    p.set_defaults(fn=_cmd_topology)
    p = sub.add_parser("cost", help="predicted time of each collective algorithm (alpha-beta link model)")
    p.add_argument("--topology", help="a shipped topology name or a .toml path (default: XELINK_TOPOLOGY, "
                                      "else discovery)")
    p.add_argument("--op", default="all_gather", choices=("all",) + _cost_ops(),
                   help="a collective, all (every collective), a distributed GEMM op, or cp_attention "
                        "(default: all_gather)")
    p.add_argument("--sizes", nargs="+", default=["1K", "24K", "1M", "16M", "96M", "1G"],
                   help="message sizes, e.g. 24K 96M 1G (default: 1K 24K 1M 16M 96M 1G)")
    p.add_argument("--nranks", type=at_least(1), help="ranks to place (default: one per device)")
    p.add_argument("--shapes", nargs="+", default=["6144", "12288"],
                   help="distributed GEMM shapes, M (a cube) or MxNxK (default: 6144 12288)")
    p.add_argument("--dtype-bytes", type=int, default=2,
                   help="distributed GEMM / cp_attention element size (default: 2, bf16)")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[16384, 65536, 131072],
                   help="cp_attention: positions of the one sequence (default: 16384 65536 131072)")
    p.add_argument("--heads", type=int, default=32, help="cp_attention: query heads (default: 32)")
    p.add_argument("--kv-heads", type=int, help="cp_attention: KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128, help="cp_attention: head dim (default: 128)")
    p.add_argument("--causal", action="store_true", help="cp_attention: causal (zigzag layout)")
    p.add_argument("--gemm-tflops", type=float,
                   help="distributed GEMM rate of one device (default: cost.GEMM_TFLOPS of its kind)")
    p.set_defaults(fn=_cmd_cost)
    p = sub.add_parser("generate", help="continue a prompt with a Hugging Face Llama folder (run under mpiexec for TP)")
    p.add_argument("--model", required=True, help="the folder (config.json, *.safetensors)")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks per group, consecutive (default: the ranks of a "
                   "package when that divides the world size / --cp, else the world size / --cp)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks per group (strided by the TP size: "
                   "--tp 2 --cp 2 on 4 ranks gives TP {0,1},{2,3} x CP {0,2},{1,3})")
    p.add_argument("--weights", default="bf16", choices=("bf16", "w8a16", "w4a16"), help="weight format")
    p.add_argument("--quantize-head", action="store_true", help="the head in --weights' format too (else dense)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="activation dtype")
    p.add_argument("--impl", default="auto", choices=("auto", "xelink", "reference"), help="kernels")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--prompt", help="text (needs tokenizer.json in the folder and the tokenizers package)")
    p.add_argument("--chat", action="store_true", help="the prompt as a user's turn in the folder's chat template "
                   "(as transformers' apply_chat_template; needs transformers)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-seq-len", type=int,
                   help="cache length (default: min(model maximum, 8192))")
    p.add_argument("--temperature", type=float, help="0 greedy (default: generation_config.json's)")
    p.add_argument("--seed", type=int, help="sampling seed")
    for flag, kind, what in (("--top-p", float, "nucleus mass when sampling"),
                             ("--top-k", int, "sample from the k most likely tokens (0: all)"),
                             ("--min-p", float, "keep tokens at least this times as likely as the top one"),
                             ("--repetition-penalty", float, "transformers' repetition penalty (1: none)"),
                             ("--min-new-tokens", int, "no end-of-sequence token before this many")):
        p.add_argument(flag, type=kind, help=f"{what} (default: generation_config.json's)")
    p.set_defaults(fn=_cmd_generate)
    # Never parsed here (main hands `xelink bench ...` to the suite first): listed for `xelink --help`.
    sub.add_parser("bench", add_help=False, help="the benchmark suite (multi-rank families under a launcher): "
                                                 "`xelink bench --help` lists its families and tools")
    args = parser.parse_args(argv)
    return run_reporting_settings(f"xelink {args.cmd}", args.fn, args)

