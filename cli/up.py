"""`tandem up`: the whole stack on one machine, as child processes: N prefill workers, M decode workers, one router.

1. `launch_commands(ns)` turns the flags into one `tandem <role> ...` command line per process (compose.yaml runs
   the same lines; tests/test_compose.py checks that). Engine flags are passed to every worker, and the model
   flags (router/server.py's MODEL_FLAGS: --model, --tokenizer, ...) to the router, so all of them agree on the
   model, its tokenizer and its context length.
2. Workers start first, then the router; each child is in its own process group and gets SIGTERM if this process
   dies without cleaning up (PR_SET_PDEATHSIG).
3. It polls the router's `/health` until it answers 200 (a prefill and a decode instance are serving), then prints
   where to connect.
4. Ctrl-C or SIGTERM: the router is stopped first (it finishes open responses), then the workers; a child that does
   not exit within --stop-timeout seconds is killed. Exit status 0.
5. A worker that exits on its own once the stack is ready is started again (--on-worker-exit restart, the default,
   as compose.yaml's `restart: unless-stopped`; at most _MAX_RESTARTS times in _RESTART_WINDOW_S): meanwhile the
   router moves its streams to the other workers and routes around it, and takes it back at the first health
   poll after it answers. `continue` leaves it stopped, `stop` stops the rest too. Any other exit (the router,
   or a worker before the stack was ready) stops the rest the same way as Ctrl-C, and `tandem up` exits 1.

`--colocated` starts the router alone, running one engine for both phases (`tandem router --colocated`): the
non-disaggregated baseline, behind the same APIs and ports.

GPUs: with `--device cuda` (or auto on a GPU host) and at least one GPU per worker, worker k gets its own,
`--device cuda:<k>`, prefill workers first (DistServe's placement: the phases never share a GPU;
every GPU stays visible to every worker, so decode maps prefill's cache through CUDA IPC and copies over NVLink).
With fewer GPUs, or `--device cuda:N`, the engines share one GPU, and each must be given a fixed KV-cache size
(--kv-cache-memory or --num-gpu-blocks-override): `main()` refuses to start them otherwise.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import fields

import torch

from engine.args import EngineArgs, add_engine_args
from engine.cpu_placement import host_cores, split_cores
from kv_transfer.registry import CHOICES as KV_CHOICES
from router.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, MAX_MESSAGE_FLAG
from router.admission import admission_flags
from router.server import MODEL_FLAGS, OPTIONAL_ROUTER_FLAGS, add_router_args
from serving.auth import ENV_API_KEY, add_api_key_args
from serving.config import WorkerConfig
from serving.metrics import DEFAULT_PREFIX, set_prefix
from serving.logs import json_line, log_flags
from serving.tls import TlsConfig, add_tls_args, tls_flags
from serving.tracing import tracing_flags

# Ports of the workers, counted up from --worker-port: prefill 0..P-1, then decode 0..D-1.
DEFAULT_WORKER_PORT = 50060
# Each worker's Prometheus /metrics port, counted up the same way from --metrics-port.
DEFAULT_METRICS_PORT = 9100
# What a child gets beyond its shutdown grace to exit before SIGKILL (the server's own stop and the engine's close).
_STOP_MARGIN_S = 5.0
# --on-worker-exit restart: a worker restarted this many times within this window is failing for good (a bad disk, a
# GPU gone): the stack stops instead of restarting it in a loop.
_MAX_RESTARTS = 5
_RESTART_WINDOW_S = 600.0
ON_WORKER_EXIT = ("restart", "continue", "stop")
CPU_PLACEMENTS = ("auto", "none")
# --log-format of this launcher's own lines (main sets it): with json they are JSON objects like the children's
# (which write to the same stdout and stderr, unprefixed), so that every line of the stack's output parses.
_log_format = "text"


def _say(message: str, file=None) -> None:
    """One line of `tandem up`'s own output (stdout, or `file`), in --log-format."""
    if _log_format == "json":
        message = json_line("up", message, "WARNING" if file is sys.stderr else "INFO", "tandem.up")
    print(message, file=file or sys.stdout, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem up", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=int, default=None, help="number of prefill workers (default: 1)")
    p.add_argument("--decode", type=int, default=None, help="number of decode workers (default: 1)")
    p.add_argument("--prefill-tp", "--prefill-tensor-parallel-size", dest="prefill_tp", type=int, default=None,
                   help="tensor-parallel ranks of each prefill worker (default: --tensor-parallel-size)")
    p.add_argument("--decode-tp", "--decode-tensor-parallel-size", dest="decode_tp", type=int, default=None,
                   help="tensor-parallel ranks of each decode worker (default: --tensor-parallel-size); it may differ "
                        "from the prefill's: both ends of a KV transfer move whole blocks, every KV head")
    p.add_argument("--kv-transfer", choices=KV_CHOICES, default=None,
                   help="how KV blocks reach the decode workers, passed to every prefill worker (tandem prefill "
                        "--help says each; default: theirs, auto)")
    p.add_argument("--colocated", action="store_true",
                   help="no workers: the router runs one engine for prefill and decode alike (the baseline the "
                        "disaggregated stack is measured against)")
    add_router_args(p)
    _action(p, "host").help = "address every process binds to (default: 127.0.0.1)"
    p.add_argument("--worker-port", type=int, default=DEFAULT_WORKER_PORT,
                   help=f"first worker gRPC port, prefill workers first, then decode (default: {DEFAULT_WORKER_PORT})")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"first worker Prometheus port, same order (default: {DEFAULT_METRICS_PORT})")
    p.add_argument("--cpu-placement", choices=CPU_PLACEMENTS, default=CPU_PLACEMENTS[0],
                   help="on the CPU: auto gives each engine its own share of this host's cores (--cpu-threads and "
                        "--cpu-cores per worker; with --colocated, all cores but one, left to the HTTP server, or "
                        "all of a host of two); "
                        "none leaves every process torch's default of one thread per core. --cpu-threads or "
                        "--cpu-cores given here apply to every engine instead (default: auto)")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds to wait for the stack to be ready (default: 900)")
    p.add_argument("--shutdown-grace", type=float, default=None,
                   help="on Ctrl-C/SIGTERM: seconds the requests in flight get to finish, passed to the router and "
                        f"every worker (default: their own, {WorkerConfig.shutdown_grace_s:g} s for workers)")
    p.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                   help="passed to every process (default: their own, info)")
    p.add_argument("--on-worker-exit", choices=ON_WORKER_EXIT, default=ON_WORKER_EXIT[0],
                   help="when a worker exits on its own after the stack is ready: restart it (the router moves its "
                        "streams elsewhere meanwhile), continue without it, or stop everything (default: "
                        f"{ON_WORKER_EXIT[0]})")
    p.add_argument("--stop-timeout", type=float, default=None,
                   help="seconds a child gets to exit before SIGKILL (default: its shutdown grace + "
                        f"{_STOP_MARGIN_S:g} s, so a draining worker is not killed mid-drain)")
    add_tls_args(p)
    add_api_key_args(p, open_paths=False)
    add_engine_args(p)
    device = _action(p, "device")
    device.default, device.help = "cpu", "cpu, cuda or auto (default: cpu, unlike the workers' own auto)"
    return p


def _action(p: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in p._actions if a.dest == dest)


def _engine_flags(ns: argparse.Namespace, names: tuple[str, ...] | None = None) -> list[str]:
    """The engine flags to pass on: --model and --device always, the others where they differ from the default."""
    out = []
    for f in fields(EngineArgs):
        if (names is not None and f.name not in names) or not hasattr(ns, f.name):
            continue
        value, flag = getattr(ns, f.name), "--" + f.name.replace("_", "-")
        if f.name not in ("model", "device") and value == f.default:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


def _process_flags(ns: argparse.Namespace) -> list[str]:
    """The flags every process gets, router and workers alike (only where given: their defaults are their own)."""
    grace = [] if ns.shutdown_grace is None else ["--shutdown-grace", f"{ns.shutdown_grace:g}"]
    prefix = [] if ns.metrics_prefix == DEFAULT_PREFIX else ["--metrics-prefix", ns.metrics_prefix]
    level = [] if ns.log_level is None else ["--log-level", ns.log_level]
    return grace + prefix + level + tls_flags(ns) + log_flags(ns) + tracing_flags(ns)


def _router_only_flags(ns: argparse.Namespace) -> list[str]:
    """The router's own flags of add_router_args beyond its ports and policy, where given (else its defaults)."""
    given = ns.max_grpc_message_bytes != DEFAULT_MAX_MESSAGE_BYTES
    out = [MAX_MESSAGE_FLAG, str(ns.max_grpc_message_bytes)] if given else []
    for dest, (flag, default) in OPTIONAL_ROUTER_FLAGS.items():
        value = getattr(ns, dest)
        if value is True:  # a switch
            out.append(flag)
        elif value != default:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def stop_timeout(ns: argparse.Namespace) -> float:
    """Seconds a child gets to exit after SIGTERM: --stop-timeout, else its grace and a margin."""
    if ns.stop_timeout is not None:
        return ns.stop_timeout
    return (WorkerConfig.shutdown_grace_s if ns.shutdown_grace is None else ns.shutdown_grace) + _STOP_MARGIN_S


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _count(n: int | None) -> int:
    """A --prefill/--decode value: 1 when not given."""
    return 1 if n is None else n


def _on_cuda(ns: argparse.Namespace) -> bool:
    return ns.device.startswith("cuda") or (ns.device == "auto" and torch.cuda.is_available())


def role_tp(ns: argparse.Namespace, role: str) -> int:
    """The tensor-parallel size of each `role` worker: --prefill-tp / --decode-tp, else --tensor-parallel-size."""
    tp = getattr(ns, f"{role}_tp", None)
    return ns.tensor_parallel_size if tp is None else tp


def _engine_tps(ns: argparse.Namespace) -> list[int]:
    """Each worker engine's tensor-parallel size, in start order (prefill workers, then decode)."""
    return [role_tp(ns, "prefill")] * _count(ns.prefill) + [role_tp(ns, "decode")] * _count(ns.decode)


def gpu_placement(ns: argparse.Namespace, num_gpus: int) -> list[str] | None:
    """Each worker engine's --device, in start order (prefill workers, then decode), when every engine can have
    GPUs of its own: an engine of tp ranks gets the next tp GPUs, named by the first (rank r runs on cuda:first+r).
    None: the engines share the one GPU --device names (cpu; an explicit cuda:N; too few GPUs; --colocated)."""
    if ns.colocated or not _on_cuda(ns) or ns.device not in ("cuda", "auto"):
        return None
    tps = _engine_tps(ns)
    if sum(tps) > num_gpus:
        return None
    firsts = [sum(tps[:k]) for k in range(len(tps))]
    return [f"cuda:{k}" for k in firsts]


# A colocated engine leaves its HTTP server a core of its own from this many cores up. The server needs a small
# share of one (event-loop work per streamed token) and the engine's threads share a core with it when none is left,
# but on two cores leaving one halves the engine's compute: there the engine takes both (bench/RESULTS.md, "CPU: a
# colocated engine on both cores").
COLOCATED_RESERVE_FROM = 3


def cpu_placement(ns: argparse.Namespace, cores: list[int]) -> list[tuple[int, str]] | None:
    """(--cpu-threads, --cpu-cores) of each engine, in start order, when --cpu-placement auto spreads them over
    `cores` (engine/cpu_placement.py says why): the workers get equal shares and the router none (it computes
    nothing); a colocated router's engine gets all but one core, which its HTTP server keeps, as vLLM's CPU build
    leaves one to its API server, except on a host of one or two cores, where it gets them all (COLOCATED_RESERVE_FROM).
    None: every engine keeps what its flags say (on CUDA, with --cpu-placement none, or with --cpu-threads /
    --cpu-cores given)."""
    if (_on_cuda(ns) or ns.cpu_placement == "none" or ns.cpu_threads is not None or ns.cpu_cores is not None
            or not cores):
        return None
    if ns.colocated:
        return split_cores(cores, 1, reserve=int(len(cores) >= COLOCATED_RESERVE_FROM))
    return split_cores(cores, _count(ns.prefill) + _count(ns.decode))


def _with_cpu(flags: list[str], placement: tuple[int, str] | None) -> list[str]:
    return flags if placement is None else [*flags, "--cpu-threads", str(placement[0]), "--cpu-cores", placement[1]]


def launch_commands(ns: argparse.Namespace, address=None, num_gpus: int = 0,
                    cores: list[int] | None = None) -> dict[str, list[str]]:
    """name -> the `tandem ...` command line of each process, in start order (workers, then the router).

    `address(name)` is the host others use to reach process `name` (compose: its service name); by default
    the bind host (127.0.0.1 when binding every interface). num_gpus: the GPUs this host has (gpu_placement).
    cores: the CPU cores this host's engines share (cpu_placement; None: no placement, as where each process
    has a host of its own).
    """
    address = address or (lambda name: _local(ns.host))
    engine = _engine_flags(ns)
    devices = gpu_placement(ns, num_gpus)
    every = _process_flags(ns)
    placed = cpu_placement(ns, cores or [])
    if ns.colocated:
        return {"router": ["tandem", "router", "--colocated", "--host", ns.host, "--grpc-port", str(ns.grpc_port),
                           "--http-port", str(ns.http_port), *_router_only_flags(ns), *admission_flags(ns), *every,
                           *_with_cpu(engine, placed and placed[0])]}
    cmds: dict[str, list[str]] = {}
    k = 0
    for role, count in (("prefill", _count(ns.prefill)), ("decode", _count(ns.decode))):
        tp = role_tp(ns, role)
        for i in range(count):
            flags = _with_cpu(_with_tp(engine, tp), placed and placed[k])
            if devices is not None:
                at = flags.index("--device")
                flags = [*flags[:at + 1], devices[k], *flags[at + 2:]]
            cmds[f"{role}-{i}"] = ["tandem", role, "--host", ns.host, "--port", str(ns.worker_port + k),
                                   "--metrics-port", str(ns.metrics_port + k), *every, *flags]
            k += 1

    def addrs(role: str) -> str:
        return ",".join(f"{address(name)}:{cmd[cmd.index('--port') + 1]}"
                        for name, cmd in cmds.items() if name.startswith(role + "-"))

    for name, cmd in cmds.items():  # a prefill sends KV only to the decode instances the router names
        if name.startswith("prefill-"):
            at = cmd.index("--metrics-port") + 2
            path = [] if ns.kv_transfer is None else ["--kv-transfer", ns.kv_transfer]
            cmd[at:at] = ["--decode-allowlist", addrs("decode"), *path]
    cmds["router"] = ["tandem", "router", "--host", ns.host, "--grpc-port", str(ns.grpc_port),
                      "--http-port", str(ns.http_port), "--prefill", addrs("prefill"), "--decode", addrs("decode"),
                      "--policy", ns.policy, *_router_only_flags(ns), *admission_flags(ns), *every,
                      *_engine_flags(ns, MODEL_FLAGS)]
    return cmds


def _with_tp(flags: list[str], tp: int) -> list[str]:
    """Engine flags with --tensor-parallel-size set to tp (left out when 1, the workers' default)."""
    out = list(flags)
    if "--tensor-parallel-size" in out:
        at = out.index("--tensor-parallel-size")
        del out[at:at + 2]
    return out + (["--tensor-parallel-size", str(tp)] if tp != 1 else [])


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, even by SIGKILL (Linux), so no worker is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _healthy(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class _Stop(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


def _raise_stop(signum, _frame):
    raise _Stop(signum)


def _stop_all(children: dict[str, subprocess.Popen], timeout: float) -> None:
    """Router first (it drains open requests), then the workers; SIGKILL for any that outlive timeout."""
    order = ["router"] + [name for name in children if name != "router"]
    for group in (order[:1], order[1:]):
        procs = [children[name] for name in group if name in children]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"tandem up: pid {proc.pid} did not stop in {timeout:.0f}s; killing it", file=sys.stderr)
                proc.kill()
                proc.wait()


def _check(ns: argparse.Namespace, num_gpus: int = 0) -> str | None:
    """What is wrong with the flags as a whole, or None."""
    if ns.nnodes != 1 or ns.node_rank != 0:
        return (f"--nnodes={ns.nnodes} --node-rank={ns.node_rank}: tandem up runs one host; run a worker whose ranks "
                "span hosts as `tandem prefill|decode --nnodes N --node-rank K` on each host (docs/operations.md)")
    if ns.colocated:
        given = [f"--{role}={n}" for role, n in (("prefill", ns.prefill), ("decode", ns.decode),
                                                  ("prefill-tp", ns.prefill_tp), ("decode-tp", ns.decode_tp))
                 if n is not None]
        if given:
            return f"{' '.join(given)}: --colocated starts no workers (one engine runs in the router); leave them out"
        return None
    if _count(ns.prefill) < 1 or _count(ns.decode) < 1:
        return f"--prefill={_count(ns.prefill)} --decode={_count(ns.decode)}: each must be >= 1"
    tps = {"--prefill-tp": ns.prefill_tp, "--decode-tp": ns.decode_tp}
    bad = next((f"{flag}={tp}" for flag, tp in tps.items() if tp is not None and tp < 1), None)
    if bad is not None:
        return f"{bad}: must be >= 1"
    if _on_cuda(ns) and max(_engine_tps(ns)) > 1 and gpu_placement(ns, num_gpus) is None:
        sizes = f"--prefill-tp={role_tp(ns, 'prefill')} --decode-tp={role_tp(ns, 'decode')}"
        return (f"{sizes}: tensor-parallel workers need GPUs of their own, {sum(_engine_tps(ns))} for these "
                f"workers with --device cuda (or auto); this host has {num_gpus}")
    engines = _count(ns.prefill) + _count(ns.decode)
    shared = _on_cuda(ns) and gpu_placement(ns, num_gpus) is None
    if shared and ns.kv_cache_memory is None and ns.num_gpu_blocks_override is None:
        # Each engine sizes its KV cache as gpu_memory_utilization x the whole GPU, minus what every process holds
        # when it looks: engines started together on one GPU race for the same memory.
        return (f"--device={ns.device} with {engines} engines on one GPU ({num_gpus} on this host, {engines} "
                "needed for one each): give each a fixed KV cache with "
                "--kv-cache-memory GiB (e.g. 24 for a 7B model's prefill and decode on one 141 GB H200) or "
                "--num-gpu-blocks-override; --gpu-memory-utilization counts the other engines' memory as used")
    return None


def main(argv: list[str] | None = None) -> int:
    global _log_format
    parser = build_parser()
    ns = parser.parse_args(argv)
    _log_format = ns.log_format
    num_gpus = torch.cuda.device_count() if _on_cuda(ns) else 0
    if (problem := _check(ns, num_gpus)) is not None:
        parser.error(problem)
    try:
        tls = TlsConfig.from_cli_args(ns)
        set_prefix(ns.metrics_prefix)  # (checked here, as the children would)
    except ValueError as e:
        parser.error(str(e))
    cmds = launch_commands(ns, num_gpus=num_gpus, cores=host_cores())
    children: dict[str, subprocess.Popen] = {}
    scheme = "https" if tls else "http"
    health_url = f"{scheme}://{_local(ns.host)}:{ns.http_port}/health"
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    status = 0
    env = os.environ if ns.api_key is None else {**os.environ, ENV_API_KEY: ns.api_key}
    restarts: dict[str, list[float]] = {}  # worker -> when it was restarted

    def start(name: str) -> None:
        # `tandem` may not be on PATH (a venv not activated): run the same entry point with this interpreter.
        cmd = cmds[name]
        children[name] = subprocess.Popen([sys.executable, "-m", "cli", *cmd[1:]], env=env,
                                          start_new_session=True, preexec_fn=_die_with_parent)
        _say(f"tandem up: started {name} (pid {children[name].pid}): {' '.join(cmd)}")

    try:
        for name in cmds:
            start(name)
        ready, deadline = False, time.monotonic() + ns.ready_timeout
        while True:
            dead = [(name, p.returncode) for name, p in children.items() if p.poll() is not None]
            fatal = None
            for name, code in dead:
                now = time.monotonic()
                recent = [t for t in restarts.get(name, []) if now - t < _RESTART_WINDOW_S]
                if name == "router" or not ready or ns.on_worker_exit == "stop" or len(recent) >= _MAX_RESTARTS:
                    fatal = fatal or (name, code, len(recent))
                elif ns.on_worker_exit == "restart":
                    _say(f"tandem up: {name} exited with status {code}; restarting it (the router routes around "
                         "it meanwhile)", file=sys.stderr)
                    restarts[name] = [*recent, now]
                    start(name)
                else:
                    _say(f"tandem up: {name} exited with status {code}; going on without it "
                         "(--on-worker-exit continue)", file=sys.stderr)
                    del children[name]
            if fatal is not None:
                name, code, n = fatal
                why = f" after {n} restarts in {_RESTART_WINDOW_S:.0f} s" if n >= _MAX_RESTARTS else ""
                _say(f"tandem up: {name} exited with status {code}{why}; stopping the rest", file=sys.stderr)
                status = 1
                break
            if not ready:
                if _healthy(health_url, tls.client_ssl_context() if tls else None):
                    ready = True
                    model = ns.served_model_name or ns.model
                    workers = ("one colocated engine (prefill and decode in the router)" if ns.colocated
                               else f"{_count(ns.prefill)} prefill, {_count(ns.decode)} decode")
                    _say(f"tandem up: ready. OpenAI API: {scheme}://{_local(ns.host)}:{ns.http_port}/v1 "
                         f"(model {model!r}); gRPC: {_local(ns.host)}:{ns.grpc_port}; "
                         f"{workers}. Ctrl-C stops everything.")
                elif time.monotonic() > deadline:
                    _say(f"tandem up: not ready after {ns.ready_timeout:.0f}s ({health_url}); stopping",
                         file=sys.stderr)
                    status = 1
                    break
            time.sleep(0.25)
    except _Stop as e:
        _say(f"tandem up: {e}: stopping")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_all(children, stop_timeout(ns))
    _say("tandem up: stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())
