"""`tandem`: one console script for every role.

  tandem generate --model smollm2 "prompt"    offline generation (chat template applied with --chat)
  tandem plan --model M --memory 80GiB ...    KV sizing: bytes per token and how many sequences fit
  tandem up                                   router + prefill + decode as local processes
  tandem router | prefill | decode            one role (for compose and Kubernetes)
"""
from __future__ import annotations

import argparse
import sys



def _role_main(cmd: str):
    """The main() of a role's command, imported only when chosen (a decode worker never imports FastAPI)."""
    if cmd == "up":
        from cli.up import main
    elif cmd == "router":
        from router.server import main
    elif cmd == "prefill":
        from prefill_svc.server import main
    elif cmd == "decode":
        from decode_svc.server import main
    else:
        assert cmd == "plan", cmd
        from engine.plan import main
    return main


ROLES = {
    "up": "start router, prefill and decode processes on this machine",
    "router": "the router: OpenAI HTTP API and the public gRPC API",
    "prefill": "a prefill worker",
    "decode": "a decode worker",
    "plan": "KV-cache sizing for a model and a memory budget",
}


def generate_parser() -> argparse.ArgumentParser:
    from engine.args import add_engine_args

    parser = argparse.ArgumentParser(prog="tandem generate", description="Generate text offline.")
    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="apply the model's chat template (default: on)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(parser)
    return parser


def generate_main(argv: list[str]) -> int:
    from engine.args import EngineArgs

    parser = generate_parser()
    ns = parser.parse_args(argv)

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p)
    except ValueError as e:
        parser.error(str(e))
    try:
        llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    except ValueError as e:  # what only loading tells (engine/args.py): the checkpoint's format, the device
        print(f"tandem generate: {e}", file=sys.stderr)
        return 1
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params)
    else:
        outs = llm.generate(ns.prompt, params)
    for prompt, out in zip(ns.prompt, outs):
        if len(ns.prompt) > 1:
            print(f"### {prompt}")
        print(out.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"generate": "generate text offline", **ROLES}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ntandem: unknown command {argv[0]!r}; choose from {', '.join(commands)}", file=sys.stderr)
            return 2
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "generate":
        return generate_main(rest)
    return _role_main(cmd)(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
