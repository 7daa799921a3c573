"""`tandem up`: the command lines it starts, and (with real processes) that a child's death stops all the others."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.up import build_parser, launch_commands

ROOT = Path(__file__).resolve().parents[2]


def commands(*argv: str) -> dict[str, list[str]]:
    return launch_commands(build_parser().parse_args(list(argv)))


def test_defaults_are_smollm2_on_cpu_one_prefill_one_decode():
    assert commands() == {
        "prefill-0": ["tandem", "prefill", "--host", "127.0.0.1", "--port", "50060", "--metrics-port", "9100",
                      "--decode-allowlist", "127.0.0.1:50061", "--model", "smollm2", "--device", "cpu"],
        "decode-0": ["tandem", "decode", "--host", "127.0.0.1", "--port", "50061", "--metrics-port", "9101",
                     "--model", "smollm2", "--device", "cpu"],
        "router": ["tandem", "router", "--host", "127.0.0.1", "--grpc-port", "50051", "--http-port", "8000",
                   "--prefill", "127.0.0.1:50060", "--decode", "127.0.0.1:50061", "--policy", "round_robin",
                   "--model", "smollm2"],
    }


def test_counts_ports_and_engine_flags_carry_over():
    cmds = commands("--prefill", "2", "--decode", "3", "--model", "random:tiny", "--grpc-port", "7000",
                    "--http-port", "7001", "--worker-port", "7100", "--metrics-port", "7200", "--device", "cuda",
                    "--served-model-name", "tiny", "--max-model-len", "512", "--block-size", "32",
                    "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--policy", "least_loaded")
    assert list(cmds) == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "router"]
    engine = ["--model", "random:tiny", "--served-model-name", "tiny", "--max-model-len", "512", "--block-size",
              "32", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching", "--device", "cuda"]
    decode_addrs = "127.0.0.1:7102,127.0.0.1:7103,127.0.0.1:7104"
    for k, name in enumerate(list(cmds)[:-1]):
        assert cmds[name][:2] == ["tandem", name.split("-")[0]]
        assert cmds[name][2:8] == ["--host", "127.0.0.1", "--port", str(7100 + k), "--metrics-port", str(7200 + k)]
        allow = ["--decode-allowlist", decode_addrs] if name.startswith("prefill") else []
        assert cmds[name][8:] == allow + engine
    assert cmds["router"] == ["tandem", "router", "--host", "127.0.0.1", "--grpc-port", "7000", "--http-port", "7001",
                              "--prefill", "127.0.0.1:7100,127.0.0.1:7101",
                              "--decode", "127.0.0.1:7102,127.0.0.1:7103,127.0.0.1:7104", "--policy", "least_loaded",
                              "--model", "random:tiny", "--served-model-name", "tiny", "--max-model-len", "512"]


def test_the_grpc_message_limit_goes_to_the_router_only_and_only_when_given():
    from router.server import build_parser as router_parser

    for argv in ([], ["--colocated"]):
        assert all("--max-grpc-message-bytes" not in cmd for cmd in commands(*argv).values())  # its own default
        cmds = commands(*argv, "--max-grpc-message-bytes", "1000")
        assert [name for name, cmd in cmds.items() if "--max-grpc-message-bytes" in cmd] == ["router"]
        assert router_parser().parse_args(cmds["router"][2:]).max_grpc_message_bytes == 1000


def test_the_step_budget_goes_to_the_workers_only_when_given():
    """Not given, each worker picks its role's own (a prefill worker on the CPU a smaller one: tests/serving/
    test_worker.py); given, even as the engine's default, every engine gets it."""
    assert not any("--max-num-batched-tokens" in cmd for argv in ([], ["--colocated"])
                   for cmd in commands(*argv).values())
    cmds = commands("--max-num-batched-tokens", "2048")
    assert [name for name, cmd in cmds.items() if "--max-num-batched-tokens" in cmd] == ["prefill-0", "decode-0"]
    assert all(cmds[name][cmds[name].index("--max-num-batched-tokens") + 1] == "2048" for name in cmds
               if name != "router")
    assert "--max-num-batched-tokens" in commands("--colocated", "--max-num-batched-tokens", "2048")["router"]


def test_binding_every_interface_still_dials_loopback():
    cmds = commands("--host", "0.0.0.0")
    assert cmds["prefill-0"][2:4] == ["--host", "0.0.0.0"]
    assert "127.0.0.1:50060" in cmds["router"]


def test_admission_flags_go_to_the_router_only():
    flags = ["--max-concurrent-requests", "32", "--max-queued-requests", "0", "--queue-timeout", "7.5",
             "--rate-limit", "100"]
    cmds = commands(*flags)
    assert cmds["router"][cmds["router"].index("--policy") + 2:][:8] == flags
    assert not any("--queue-timeout" in cmd for name, cmd in cmds.items() if name != "router")
    assert commands("--colocated", "--queue-timeout", "5")["router"][9:11] == ["--queue-timeout", "5"]


def test_migration_flags_go_to_the_router_only_and_only_when_given():
    cmds = commands("--migration-limit", "0", "--migration-timeout", "5")
    router = cmds["router"]
    assert router[router.index("--migration-limit"):][:4] == ["--migration-limit", "0", "--migration-timeout", "5"]
    assert not any("--migration-limit" in cmd for name, cmd in cmds.items() if name != "router")
    assert not any(flag in commands()["router"] for flag in ("--migration-limit", "--migration-timeout"))
    # The launcher's own: what it does when a worker exits (restart by default); never passed on.
    assert build_parser().parse_args([]).on_worker_exit == "restart"
    assert not any("--on-worker-exit" in cmd for cmd in commands("--on-worker-exit", "stop").values())


def test_the_tokenizer_flag_goes_to_every_role_so_they_share_one_vocabulary():
    """--tokenizer DIR: each worker detokenizes with it and the router tokenizes and renders chats with it, so
    `tandem up` passes it to all of them (the router among its model flags), colocated too; never when not given."""
    from decode_svc.server import build_parser as decode_parser
    from prefill_svc.server import build_parser as prefill_parser
    from router.server import build_parser as router_parser
    from router.server import engine_only_flags

    parsers = {"prefill": prefill_parser(), "decode": decode_parser(), "router": router_parser()}
    cmds = commands("--prefill", "2", "--model", "random:tiny", "--tokenizer", "/tok", "--max-model-len", "64")
    assert list(cmds) == ["prefill-0", "prefill-1", "decode-0", "router"]
    for name, cmd in cmds.items():
        assert cmd[cmd.index("--tokenizer"):][:2] == ["--tokenizer", "/tok"], name
        ns = parsers[cmd[1]].parse_args(cmd[2:])
        assert ns.tokenizer == "/tok" and ns.model == "random:tiny", name
    assert cmds["router"][-6:] == ["--model", "random:tiny", "--max-model-len", "64", "--tokenizer", "/tok"]
    assert engine_only_flags(router_parser().parse_args(cmds["router"][2:])) == []  # a model flag, not refused
    colocated = commands("--colocated", "--tokenizer", "/tok")["router"]
    assert colocated[colocated.index("--tokenizer"):][:2] == ["--tokenizer", "/tok"]
    assert not any("--tokenizer" in cmd for cmd in commands().values())


def test_each_command_parses_with_its_roles_own_parser():
    from decode_svc.server import build_parser as decode_parser
    from prefill_svc.server import build_parser as prefill_parser
    from router.server import build_parser as router_parser

    parsers = {"prefill": prefill_parser(), "decode": decode_parser(), "router": router_parser()}
    for cmd in commands("--decode", "2", "--max-model-len", "512", "--no-enable-prefix-caching").values():
        ns = parsers[cmd[1]].parse_args(cmd[2:])
        assert ns.model == "smollm2" and ns.max_model_len == 512


def test_shutdown_grace_goes_to_every_process_and_the_stop_timeout_covers_it():
    from decode_svc.server import build_parser as decode_parser
    from prefill_svc.server import build_parser as prefill_parser
    from router.server import build_parser as router_parser
    from cli.up import stop_timeout

    parsers = {"prefill": prefill_parser(), "decode": decode_parser(), "router": router_parser()}
    for argv in (["--shutdown-grace", "40"], ["--shutdown-grace", "40", "--colocated"]):
        for cmd in commands(*argv).values():
            assert parsers[cmd[1]].parse_args(cmd[2:]).shutdown_grace == 40, cmd
    assert all("--shutdown-grace" not in cmd for cmd in commands().values())  # their own defaults
    # A child gets SIGKILL only after its grace: the workers' 25 s drain used to be cut at a fixed 15 s.
    assert stop_timeout(build_parser().parse_args([])) == 30
    assert stop_timeout(build_parser().parse_args(["--shutdown-grace", "40"])) == 45
    assert stop_timeout(build_parser().parse_args(["--shutdown-grace", "40", "--stop-timeout", "3"])) == 3


def _free_base(n: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _tandem_up(*extra: str) -> tuple[subprocess.Popen, dict[str, int]]:
    """`tandem up` with random:tiny on free ports, once it says it is ready; and its children's pids by name."""
    base = _free_base(6)
    proc = subprocess.Popen([sys.executable, "-m", "cli", "up", "--model", "random:tiny", "--http-port",
                             str(base), "--grpc-port", str(base + 1), "--worker-port", str(base + 2),
                             "--metrics-port", str(base + 4), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, pids = [], {}
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        lines.append(line)
        if m := re.match(r"tandem up: started (\S+) \(pid (\d+)\)", line):
            pids[m.group(1)] = int(m.group(2))
        if "tandem up: ready." in line or time.monotonic() > deadline:
            break
    if "tandem up: ready." not in lines[-1]:
        proc.kill()
        proc.wait()
        raise AssertionError("tandem up did not get ready:\n" + "".join(lines[-40:]))
    assert sorted(pids) == ["decode-0", "prefill-0", "router"]
    return proc, pids


def test_a_dead_child_stops_the_others_and_tandem_up_fails():
    """Under --on-worker-exit stop (the default restarts a worker: tests/e2e/test_migration_e2e.py)."""
    proc, pids = _tandem_up("--on-worker-exit", "stop")
    try:
        os.kill(pids["decode-0"], signal.SIGKILL)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "decode-0 exited with status -9; stopping the rest" in rest
    assert [name for name, pid in pids.items() if _alive(pid)] == []


def test_children_die_with_a_killed_launcher():
    proc, pids = _tandem_up()
    proc.kill()  # SIGKILL: no clean-up runs in the launcher; PR_SET_PDEATHSIG must stop its children
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [name for name, pid in pids.items() if _alive(pid)]
    for name in orphans:  # do not leave them behind when the test fails
        os.kill(pids[name], signal.SIGKILL)
    proc.stdout.close()
    assert orphans == []


def test_router_takes_instances_from_flags_or_environment(monkeypatch):
    from router.server import ENV_DECODE, ENV_PREFILL, parse_addresses

    monkeypatch.setenv(ENV_DECODE, "decode-0:50061, decode-1:50062")
    assert parse_addresses(None, ENV_DECODE) == ["decode-0:50061", "decode-1:50062"]
    assert parse_addresses("10.0.0.5:7000", ENV_DECODE) == ["10.0.0.5:7000"]  # the flag wins
    monkeypatch.delenv(ENV_PREFILL, raising=False)
    with pytest.raises(ValueError, match="--prefill: no instances given"):
        parse_addresses(None, ENV_PREFILL)
    with pytest.raises(ValueError, match=r"--decode='decode-0': must be host:port"):
        parse_addresses("decode-0", ENV_DECODE)


def test_each_engine_gets_gpus_of_its_own_when_the_host_has_enough():
    from cli.up import _check, gpu_placement

    ns = build_parser().parse_args(["--prefill", "1", "--decode", "2", "--device", "cuda"])
    cmds = launch_commands(ns, num_gpus=4)
    devices = {name: cmd[cmd.index("--device") + 1] for name, cmd in cmds.items() if name != "router"}
    assert devices == {"prefill-0": "cuda:0", "decode-0": "cuda:1", "decode-1": "cuda:2"}
    assert _check(ns, num_gpus=4) is None  # no GPU is shared: each engine may size its cache from its GPU
    assert "--device" not in cmds["router"]
    # Too few GPUs: the engines share the default one and need fixed KV caches.
    assert gpu_placement(ns, 2) is None
    assert _check(ns, num_gpus=2).startswith("--device=cuda with 3 engines on one GPU (2 on this host, 3 needed")
    # Tensor-parallel workers: each takes the next tp GPUs (rank r on cuda:first+r); the sizes may differ per role.
    tp = build_parser().parse_args(["--device", "cuda", "--tensor-parallel-size", "2", "--decode", "2",
                                    "--decode-tp", "1"])
    assert _check(tp, num_gpus=4) is None
    cmds = launch_commands(tp, num_gpus=4)
    assert {name: (cmd[cmd.index("--device") + 1], cmd[cmd.index("--tensor-parallel-size") + 1]
                   if "--tensor-parallel-size" in cmd else "1") for name, cmd in cmds.items() if name != "router"} == {
        "prefill-0": ("cuda:0", "2"), "decode-0": ("cuda:2", "1"), "decode-1": ("cuda:3", "1")}
    assert "--tensor-parallel-size" not in cmds["router"]
    assert _check(tp, num_gpus=3) == ("--prefill-tp=2 --decode-tp=1: tensor-parallel workers need GPUs of their own, "
                                      "4 for these workers with --device cuda (or auto); this host has 3")
    assert _check(build_parser().parse_args(["--decode-tp", "0"])) == "--decode-tp=0: must be >= 1"
    assert "--colocated starts no workers" in _check(build_parser().parse_args(["--colocated", "--prefill-tp", "2"]))
    assert _check(build_parser().parse_args(["--nnodes", "2"])).startswith("--nnodes=2 --node-rank=0: tandem up runs one")
    assert _check(build_parser().parse_args(["--colocated", "--tensor-parallel-size", "2"]), num_gpus=2) is None
    # An explicit GPU, the CPU and --colocated: no placement.
    for argv in (["--device", "cuda:1"], ["--device", "cpu"], ["--colocated", "--device", "cuda"]):
        assert gpu_placement(build_parser().parse_args(argv), 8) is None


def test_cpu_placement_splits_the_cores_between_engines():
    def flags(*argv, cores=(0, 1)):
        cmds = launch_commands(build_parser().parse_args(list(argv)), cores=list(cores))
        return {name: cmd[cmd.index("--cpu-threads"):] if "--cpu-threads" in cmd else [] for name, cmd in cmds.items()}

    assert flags() == {"prefill-0": ["--cpu-threads", "1", "--cpu-cores", "0"],
                       "decode-0": ["--cpu-threads", "1", "--cpu-cores", "1"], "router": []}
    # colocated: one core is left to the router's HTTP server, but of two the engine takes both
    assert flags("--colocated") == {"router": ["--cpu-threads", "2", "--cpu-cores", "0-1"]}
    assert flags("--colocated", cores=[0]) == {"router": ["--cpu-threads", "1", "--cpu-cores", "0"]}
    assert flags("--colocated", cores=range(3)) == {"router": ["--cpu-threads", "2", "--cpu-cores", "1-2"]}
    assert flags("--colocated", cores=range(8)) == {"router": ["--cpu-threads", "7", "--cpu-cores", "1-7"]}
    assert flags("--prefill", "2", "--decode", "2", cores=range(8))["decode-1"] == ["--cpu-threads", "2",
                                                                                   "--cpu-cores", "6-7"]
    # more engines than cores: one thread each, the cores in turn
    assert [f[-1] for f in flags("--prefill", "2").values() if f] == ["0", "1", "0"]
    # none, or flags given for every engine: no split
    assert flags("--cpu-placement", "none") == {"prefill-0": [], "decode-0": [], "router": []}
    assert flags("--cpu-threads", "2")["decode-0"] == ["--cpu-threads", "2"]
    assert launch_commands(build_parser().parse_args([]))["decode-0"][-2:] == ["--device", "cpu"]  # no cores: none
